"""Inference: KV/state-cached generation from a checkpoint (`generate.py`), shared by the
sampling CLI, the RL rollouts and the benchmarks."""
