"""Per-layer torch.compile with our Inductor passes: what parallelize.py calls.

    apply_compile(model, backend="inductor", fullgraph=True, passes=PASS_NAMES)

Each decoder layer is compiled on its own (torchtitan's per-block compile); the passes are
installed through `torch.compile(options=...)`, so they apply to these compiles only.
"""

from collections.abc import Sequence

import torch

from compile_passes.registry import PASS_NAMES, check_pass_names, inductor_options
from titan_moe.model.model import TitanMoE


def apply_compile(
    model: TitanMoE,
    backend: str = "inductor",
    fullgraph: bool = True,
    passes: Sequence[str] = PASS_NAMES,
) -> None:
    check_pass_names(passes)
    if passes and backend != "inductor":
        raise ValueError(
            f"compile.passes {list(passes)} are Inductor passes; compile.backend is {backend!r} "
            "(allowed with passes: 'inductor'; or set compile.passes = [])"
        )
    options = inductor_options(passes) if backend == "inductor" else None
    for layer_id, layer in model.layers.named_children():
        compiled = torch.compile(layer, backend=backend, fullgraph=fullgraph, options=options)
        model.layers.register_module(layer_id, compiled)
