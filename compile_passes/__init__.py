"""torch.compile tooling for titan_moe; `python -m compile_passes.inspect` shows what it builds."""
