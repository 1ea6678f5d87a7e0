"""Our Inductor passes by name, and the one `joint_custom_post_pass` hook that runs them.

    FusionPasses(["situ_glu", "attn_res", "kda_gate"])    -> a torch._inductor CustomGraphPass
    inductor_options(names)                               -> torch.compile(options=...) for it

The hook runs on AOTAutograd's joint forward+backward graph (and on inference graphs), after
Inductor's own joint normalisation (no-op removal, early patterns), which is the form the
patterns were traced in, less one difference it removes first: conversions of a tensor to the
dtype it already has. Under CUDA autocast the backward of an fp32 matrix-vector product (an
AttnRes site's score, computed with autocast off) is traced with such no-op conversions around
it; the patterns, traced outside autocast, have none, so no site matched on the H200 (torch 2.11)
until they were dropped. Every match is counted in `torch._dynamo.utils.counters
["compile_passes"][name]`, which the tests and bench/compile.py read.
"""

import functools
import hashlib
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from torch._dynamo.utils import counters
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch._inductor.pattern_matcher import PatternMatcherPass, stable_topological_sort

# name -> module; each module has `pattern_pass() -> PatternMatcherPass`.
PASS_MODULES = {
    "situ_glu": "compile_passes.situ_glu_fusion",
    "attn_res": "compile_passes.attn_res_fusion",
    "kda_gate": "compile_passes.kda_gate_cumsum_fusion",
}
PASS_NAMES = tuple(PASS_MODULES)
COUNTER = "compile_passes"


def check_pass_names(names: Sequence[str], field: str = "compile.passes") -> None:
    """ValueError naming `field` and the allowed names unless every name is a known pass."""
    unknown = [n for n in names if n not in PASS_MODULES]
    if unknown:
        raise ValueError(
            f"{field}: unknown pass {', '.join(map(repr, unknown))}; allowed: "
            f"{', '.join(PASS_NAMES)}"
        )
    if len(set(names)) != len(names):
        raise ValueError(f"{field}: a pass is listed twice: {list(names)}")


@functools.cache
def _pattern_pass(name: str) -> PatternMatcherPass:
    return importlib.import_module(PASS_MODULES[name]).pattern_pass()


class FusionPasses(CustomGraphPass):
    """Applies the named pattern passes in order; `then` (e.g. a recorder) runs afterwards."""

    def __init__(
        self, names: Sequence[str], then: Callable[[torch.fx.Graph], None] | None = None
    ) -> None:
        check_pass_names(names, "passes")
        self.names = tuple(names)
        self.then = then

    def __call__(self, graph: torch.fx.Graph) -> None:
        drop_noop_conversions(graph)
        total = 0
        for name in self.names:
            matched = _pattern_pass(name).apply(graph) or 0
            counters[COUNTER][name] += matched
            total += matched
        if total:
            # A replacement is inserted at its first match node; later users come first.
            stable_topological_sort(graph)
            graph.eliminate_dead_code()
        if self.then is not None:
            self.then(graph)

    def uuid(self) -> str | None:
        if self.then is not None:
            return None  # a recorder must see every compile: no cache hits
        digest = hashlib.sha256(",".join(self.names).encode())
        for path in pass_sources(self.names):
            digest.update(path.read_bytes())
        digest.update(torch.__version__.encode())
        return digest.hexdigest()


def pass_sources(names: Sequence[str]) -> list[Path]:
    """The files the named passes' compiled graphs depend on: this registry, each pass module,
    and every titan_moe module a pass takes a function from, and so on transitively (its patterns
    are traced from the model's own code, which may call on into titan_moe.ops, e.g. the AttnRes
    site's reference; an edit there must miss Inductor's cache too)."""
    files = {Path(__file__)}
    pending = [importlib.import_module(PASS_MODULES[name]) for name in names]
    seen = {module.__name__ for module in pending}
    while pending:
        module = pending.pop()
        files.add(Path(module.__file__))
        for value in vars(module).values():
            origin = getattr(value, "__module__", None)
            if isinstance(origin, str) and origin.startswith("titan_moe.") and origin not in seen:
                seen.add(origin)
                pending.append(sys.modules[origin])
    return sorted(files)


def drop_noop_conversions(graph: torch.fx.Graph) -> int:
    """Removes every `prims.convert_element_type(x, dtype)` whose x already has that dtype (its
    users read x instead); one that is a graph output stays, since an output may not become an
    alias of an input. Returns how many were removed."""
    removed = 0
    for node in list(graph.nodes):
        if node.target is not torch.ops.prims.convert_element_type.default:
            continue
        source, dtype = node.args[0], node.args[1]
        value = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
        if (not isinstance(value, torch.Tensor) or value.dtype != dtype
                or any(user.op == "output" for user in node.users)):
            continue
        node.replace_all_uses_with(source)
        graph.erase_node(node)
        removed += 1
    return removed


def inductor_options(names: Sequence[str]) -> dict:
    """`torch.compile(..., options=...)` that installs the passes for that compile only."""
    return {"joint_custom_post_pass": FusionPasses(names)} if names else {}


def matched_counts() -> dict[str, int]:
    """Matches per pass since the counters were last cleared."""
    return {name: counters[COUNTER][name] for name in PASS_NAMES}
