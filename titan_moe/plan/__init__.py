"""Planning on paper: the per-GPU memory plan of a parallel layout (`memory.py`), pipeline
stages cut on AttnRes blocks (`pipeline.py`), both printed by `python -m titan_moe.plan`
(`cli.py`), and a flavor's parameter and FLOP counts (`params.py`)."""
