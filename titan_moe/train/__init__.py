"""The trainer: `trainer.py` (torchtitan's Trainer with our train spec; `python -m
titan_moe.train`), `config.py` (the TOML/CLI sections and their checks; `python -m
titan_moe.train.config` checks only), `platform.py` (CPU or CUDA), `optimizer.py`,
`chunked_loss.py`, `step_guard.py` (non-finite steps) and `checkpoint_verify.py`."""
