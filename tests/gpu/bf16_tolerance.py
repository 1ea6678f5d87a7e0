"""The bf16 tolerance the CUDA parity tests share: error relative to the largest magnitude
(tests/metrics.py's rel_max)."""

BF16_RTOL = 3e-2
