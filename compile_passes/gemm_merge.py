"""Inductor pass: GEMMs that share an operand, or whose products are summed, as one GEMM.

    x @ B_1, …, x @ B_n          ->  x @ [B_1 | … | B_n], then column slices
    A_1 @ x, …, A_n @ x          ->  [A_1; …; A_n] @ x,   then row slices
    A_1 @ B_1 + … + A_n @ B_n    ->  [A_1 | … | A_n] @ [B_1; …; B_n]

A layer of small GEMMs is bound by its host: each GEMM is one library call from Inductor's
wrapper, whatever its size. LatentMoE reads its input x four times (the router, W_down and the
shared expert's W1 and W3): four GEMMs forward, and backward four weight-gradient GEMMs (each
against x) and four input-gradient GEMMs summed into x's gradient. Merged, that is one GEMM each
way of the three, as a fused QKV projection is in attention layers; the same holds for any
projections of one input.

Dtypes: members share their operands' dtype. Where their outputs differ (the router's fp32
`mm.dtype` beside bf16 GEMMs, CUDA only, as torch has no CPU `mm.dtype` kernel) the merged GEMM
returns fp32 and a bf16 member is its slice rounded once, as a bf16-output GEMM rounds its fp32
accumulator once (the sums' order may differ). A merged sum accumulates its n products in one
fp32 accumulator and rounds once, where the graph rounded each product and each partial sum.

What is left alone: float8 linears (`_scaled_mm`, not mm), batched GEMMs, and a GEMM whose other
operand depends on another member (merging would make a cycle). A merged output is one buffer:
a member slice saved for backward keeps the whole buffer alive, not just its columns.
"""

import contextlib
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._inductor.pattern_matcher import stable_topological_sort
from torch.utils._pytree import tree_leaves, tree_map

NAME = "gemm_merge"
aten, prims = torch.ops.aten, torch.ops.prims
CONVERT = prims.convert_element_type.default


@dataclass(frozen=True)
class Gemm:
    """One 2-D GEMM node: node = a @ b, returned in out_dtype."""

    node: fx.Node
    a: fx.Node
    b: fx.Node
    out_dtype: torch.dtype

    @property
    def operand_dtype(self) -> torch.dtype:
        return _val(self.a).dtype


def _val(node: fx.Node) -> torch.Tensor:
    return node.meta["val"]


def as_gemm(node: fx.Node) -> Gemm | None:
    """The GEMM that node is (`aten.mm`, or `aten.mm.dtype` with its output dtype), else None."""
    if node.op != "call_function" or node.target not in (aten.mm.default, aten.mm.dtype):
        return None
    a, b = node.args[:2]
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
        return None
    out_dtype = _val(node).dtype
    return Gemm(node, a, b, out_dtype)


def _emit(graph: fx.Graph, target, *args) -> fx.Node:
    """graph.call_function(target, args) with its meta["val"], computed in the graph's fake mode."""
    node = graph.call_function(target, args)
    values = tree_map(lambda a: _val(a) if isinstance(a, fx.Node) else a, args)
    mode = detect_fake_mode(tree_leaves(values))
    with mode if mode is not None else contextlib.nullcontext():
        node.meta["val"] = target(*values)
    return node


def _transposed_source(node: fx.Node) -> fx.Node | None:
    if node.op == "call_function" and (
        node.target is aten.t.default
        or (node.target is aten.permute.default and list(node.args[1]) == [1, 0])
    ):
        return node.args[0]
    return None


def _cat(graph: fx.Graph, nodes: list[fx.Node], dim: int) -> fx.Node:
    """cat(nodes, dim) for 2-D nodes. Transposes are concatenated as (cat of their sources)ᵀ, so
    the copy reads and writes whole rows; a cat along the same dim that only this one reads is
    spliced in, not copied twice."""
    sources = [_transposed_source(n) for n in nodes]
    if all(s is not None for s in sources):
        return _emit(graph, aten.permute.default, _cat(graph, sources, 1 - dim), [1, 0])
    parts: list[fx.Node] = []
    for n in nodes:
        inner = n.op == "call_function" and n.target is aten.cat.default and len(n.users) == 1
        if inner and (n.args[1] if len(n.args) > 1 else 0) % 2 == dim:
            parts.extend(n.args[0])
        else:
            parts.append(n)
    return _emit(graph, aten.cat.default, parts, dim)


def _merged_gemm(graph: fx.Graph, a: fx.Node, b: fx.Node, out_dtype, operand_dtype) -> fx.Node:
    if out_dtype == operand_dtype:
        return _emit(graph, aten.mm.default, a, b)
    return _emit(graph, aten.mm.dtype, a, b, out_dtype)


def _in_dtype(graph: fx.Graph, node: fx.Node, dtype: torch.dtype) -> fx.Node:
    return node if _val(node).dtype == dtype else _emit(graph, CONVERT, node, dtype)


def _out_dtype(gemms: list[Gemm]) -> torch.dtype:
    dtypes = {g.out_dtype for g in gemms}
    return dtypes.pop() if len(dtypes) == 1 else torch.float32


def _compatible(gemms: list[Gemm]) -> list[list[Gemm]]:
    """Members that may share one GEMM: one operand dtype and device; one output dtype unless on
    CUDA (fp32 `mm.dtype` beside half-precision GEMMs)."""
    kinds: dict[tuple, list[Gemm]] = defaultdict(list)
    for g in gemms:
        device = _val(g.node).device
        out = None if device.type == "cuda" else g.out_dtype
        kinds[(g.operand_dtype, device, out)].append(g)
    return [members for members in kinds.values() if len(members) > 1]


def _depends_on(node: fx.Node, targets: set[fx.Node], position: dict[fx.Node, int]) -> bool:
    """Whether node depends on a node in targets; the graph is in topological order, so nothing
    placed before the earliest target is searched."""
    if not targets:
        return False
    first = min(position[t] for t in targets)
    seen, pending = set(), [node]
    while pending:
        n = pending.pop()
        if n in targets:
            return True
        if n in seen or position[n] < first:
            continue
        seen.add(n)
        pending.extend(n.all_input_nodes)
    return False


# ---- x @ B_i and A_i @ x ---------------------------------------------------------------------


def _acyclic(members: list[Gemm], side: int, position: dict[fx.Node, int]) -> list[Gemm]:
    """The members in graph order, less each one whose other operand depends on a kept one (an
    earlier member's operands come before it, so they cannot depend on a later member)."""
    kept: list[Gemm] = []
    for g in sorted(members, key=lambda g: position[g.node]):
        if not _depends_on(g.b if side == 0 else g.a, {k.node for k in kept}, position):
            kept.append(g)
    return kept


def _merge_shared_operand(graph: fx.Graph, members: list[Gemm], side: int) -> None:
    """side 0: members a @ b_i with a shared; side 1: a_i @ b with b shared."""
    out_dtype = _out_dtype(members)
    others = [g.b if side == 0 else g.a for g in members]
    widths = [_val(n).shape[1 - side] for n in others]
    with graph.inserting_before(members[-1].node):
        stacked = _cat(graph, others, 1 - side)
        a, b = (members[0].a, stacked) if side == 0 else (stacked, members[0].b)
        merged = _merged_gemm(graph, a, b, out_dtype, members[0].operand_dtype)
        start = 0
        for g, width in zip(members, widths, strict=True):
            part = _emit(graph, aten.slice.Tensor, merged, 1 - side, start, start + width)
            g.node.replace_all_uses_with(_in_dtype(graph, part, g.out_dtype))
            start += width
    for g in members:
        graph.erase_node(g.node)
    # The merged GEMM sits where the last member was; earlier members' users move after it.
    stable_topological_sort(graph)


def merge_shared_operands(graph: fx.Graph) -> int:
    """Merges every group of ≥ 2 GEMMs with one operand in common (first operands first).
    Returns the number of GEMMs removed. A group found dependent stays so after other merges
    (a merge adds dependencies, never removes one), so each group is checked once, when merged.
    Members' widths must be static: a slice of a symbolic width would need its size node."""
    removed = 0
    for side in (0, 1):
        groups: dict[fx.Node, list[Gemm]] = defaultdict(list)
        for node in graph.nodes:
            g = as_gemm(node)
            if g is not None and node.users and isinstance(
                    _val(g.b if side == 0 else g.a).shape[1 - side], int):
                groups[g.a if side == 0 else g.b].append(g)
        for gemms in list(groups.values()):
            for members in _compatible(gemms):
                position = {n: i for i, n in enumerate(graph.nodes)}
                members = _acyclic(members, side, position)
                if len(members) > 1:
                    _merge_shared_operand(graph, members, side)
                    removed += len(members) - 1
    return removed


# ---- Σ A_i @ B_i -----------------------------------------------------------------------------


def _is_add(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target is aten.add.Tensor
            and not node.kwargs and len(node.args) == 2)


def _sum_terms(root: fx.Node) -> tuple[list, list[fx.Node]]:
    """(terms, adds) of the add tree at root: it descends into operands that are adds of root's
    shape and dtype read by nothing else."""
    terms, adds, pending = [], [root], list(root.args)
    while pending:
        n = pending.pop(0)
        inner = (isinstance(n, fx.Node) and _is_add(n) and len(n.users) == 1
                 and _val(n).shape == _val(root).shape and _val(n).dtype == _val(root).dtype)
        if inner:
            adds.append(n)
            pending[:0] = n.args
        else:
            terms.append(n)
    return terms, adds


def _term_gemm(term, root: fx.Node) -> Gemm | None:
    """The GEMM a term is, itself or converted once to root's dtype, read only by the sum."""
    if not isinstance(term, fx.Node) or len(term.users) != 1:
        return None
    if _val(term).shape != _val(root).shape or _val(term).dtype != _val(root).dtype:
        return None
    if term.target is CONVERT and isinstance(term.args[0], fx.Node):
        inner = term.args[0]
        return as_gemm(inner) if len(inner.users) == 1 else None
    return as_gemm(term)


def merge_sums(graph: fx.Graph) -> int:
    """Merges the GEMM terms of every sum that has ≥ 2 of them. Returns the GEMMs removed."""
    removed = 0
    roots = [n for n in graph.nodes if _is_add(n)
             and not (len(n.users) == 1 and _is_add(next(iter(n.users))))]
    for root in roots:
        terms, adds = _sum_terms(root)
        if len(set(terms)) != len(terms):
            continue  # a term counted twice (x + x) is left to the graph
        gemms = {t: _term_gemm(t, root) for t in terms}
        groups = _compatible([g for g in gemms.values() if g is not None])
        if not groups:
            continue
        members = max(groups, key=len)
        merged_terms = {g.node for g in members}
        rest = [t for t in terms if gemms[t] is None or gemms[t].node not in merged_terms]
        dtype = _val(root).dtype
        with graph.inserting_before(root):
            a = _cat(graph, [g.a for g in members], 1)
            b = _cat(graph, [g.b for g in members], 0)
            total = _merged_gemm(graph, a, b, _out_dtype(members), members[0].operand_dtype)
            total = _in_dtype(graph, total, dtype)
            for t in rest:
                total = _emit(graph, aten.add.Tensor, total, t)
        root.replace_all_uses_with(total)
        replaced = {*adds, *(t for t in terms if t not in rest), *merged_terms}
        for node in reversed(list(graph.nodes)):  # users before what they read
            if node in replaced and not node.users:
                graph.erase_node(node)
        removed += len(members) - 1
    return removed


class GemmMerge:
    """The pass: sums first (their GEMMs are then gone from the shared-operand groups), then
    shared operands. `apply(graph)` returns the number of GEMMs removed."""

    def apply(self, graph: fx.Graph) -> int:
        return merge_sums(graph) + merge_shared_operands(graph)


def graph_pass() -> GemmMerge:
    return GemmMerge()
