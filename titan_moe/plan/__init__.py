"""Planning on paper: the per-GPU memory plan of a parallel layout (`memory.py`, also
`python -m titan_moe.plan`) and a flavor's parameter and FLOP counts (`params.py`)."""
