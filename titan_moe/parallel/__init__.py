"""Parallelism applied from outside the model (torchtitan style): `parallelize.py` applies
context parallelism, float8, expert parallelism, activation checkpointing, compile and sharding
(FSDP2 or `simple_fsdp.py`) in that order; the model knows no mesh."""
