"""Scalar C++ kernels for the CPU compile tests.

`cpp.simdlen` 1 makes Inductor generate scalar C++ kernels, which about halves a cold CPU
compile. The compile tests check what is decided before C++ code generation (traces, graph
breaks, the passes' matches, the graphs' split and buffers) and results against eager, none of
which depends on the kernels' vector width. Tests that count generated kernels keep the default.
"""

import torch

SCALAR_CPP = {"cpp.simdlen": 1}


def scalar_cpp(**options: object):
    """Inductor's config patched for scalar C++ kernels (and `options`), as a context manager or
    a decorator."""
    return torch._inductor.config.patch({**SCALAR_CPP, **options})
