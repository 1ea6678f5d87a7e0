"""Planning on paper: the per-GPU memory plan of a parallel layout (`memory.py`, over the TOML's
`config.py` and what a layer saves, `saved.py`) and the layouts searched (`layouts.py`),
pipeline stages cut on AttnRes blocks (`pipeline.py`), all printed by `python -m titan_moe.plan`
(`cli.py`; `validate.py` checks a plan on one GPU), and a flavor's parameter and FLOP counts
(`params.py`)."""
