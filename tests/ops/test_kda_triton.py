"""The KDA Triton op, run by Triton's CPU interpreter, against the float64 chunked reference.

All cases run in one child process under Triton's interpreter (tests/ops/interpreter.py says
why) that reports relative errors.
`chunk_kda_torch` in float64 is the reference (it equals the recurrence to 1e-10,
tests/ops/test_kda_reference.py). Outputs and every gradient are compared as relative RMS
error, ||got - want|| / ||want||: float32 inputs within 1e-4 (IEEE GEMMs); bf16 inputs (the
bf16 tensor-core operands, emulated by rounding under the interpreter) within the bounds of the
GPU test, 5e-3 for outputs and 2e-2 for gradients, against float64 on the same bf16 values.
The interpreter truncates fp32 to bf16 where the GPU rounds to nearest, so the emulated GEMM
operands round by chunk_common.round_to_bf16 (checked here against torch). The kernels' bf16
stores still truncate: that alone puts 3.3e-3 relative RMS on the output, where the GPU's
rounding puts 1.7e-3, so these bounds are harder to meet here than on the GPU.
"""

import json
import warnings

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tests.metrics import rel_rms
from tests.ops.interpreter import guarded
from titan_moe.ops.kda.chunk_common import round_to_bf16

FP32_RTOL = 1e-4  # float32 kernels (IEEE GEMMs) vs float64
BF16_O_RTOL, BF16_GRAD_RTOL = 5e-3, 2e-2  # tests/gpu/test_kda_triton_cuda.py's bounds
G_MIN = -5.0
GRADS = ("q", "k", "v", "g", "beta", "initial_state")

# name -> (batch, seq_len, heads, d_k, d_v, gate, documents, initial state + final state).
# The interpreter's time grows with batch x heads x chunks (programs run one by one), so
# batch 2 x heads 2 is taken twice: here, without documents, and by bf16-doc-ids-fused-gate
# (BF16_CASES), where the document ids of a row serve all its heads; the other document cases
# take heads 1.
CASES = {
    "T100-random": (2, 100, 2, 32, 16, "random", None, True),
    "T64-pinned": (1, 64, 1, 16, 32, "pinned", None, True),
    "T130-near-zero": (1, 130, 1, 16, 16, "near_zero", None, False),
    "doc-ids-mid-chunk": (2, 100, 1, 16, 16, "random", "doc_ids", True),
    "cu-seqlens": (1, 150, 1, 16, 16, "random", "cu_seqlens", False),
    "fused-gate-K24-V80": (1, 70, 2, 24, 80, "fused", None, True),
}
# Sequences run by segments (chunk_triton.SEGMENT set to a few chunks): name -> (case as above,
# input dtype, segment tokens). Documents begin at a segment boundary (row 0 at 64) and cross
# one (row 1); the last segment is partial; heads 2 hand their states over apart (bf16 case).
# Each is also run whole, against float64 as well: a case of CASES with the same inputs
# (float32) is that whole run's report, not run again.
SEGMENT_CASES = {
    "segments-64-doc-ids": (CASES["doc-ids-mid-chunk"], torch.float32, 64),
    "segments-64-bf16-fused-H2": ((1, 130, 2, 32, 32, "fused", None, True), torch.bfloat16, 64),
    "segments-64-no-state": (CASES["cu-seqlens"], torch.float32, 64),
}
SEGMENT_VS_WHOLE_RTOL = 1e-6  # the same kernels, the state handed over in fp32
# The same op on bf16 q, k, v, g, beta (fp32 initial and final states, the chunk-entry states
# and their gradients stored in bf16): name -> case as above.
BF16_CASES = {
    "bf16-T200-random": (1, 200, 1, 64, 64, "random", None, True),
    "bf16-T130-pinned": (1, 130, 1, 64, 32, "pinned", None, True),
    "bf16-doc-ids-fused-gate": (2, 100, 2, 32, 32, "fused", "doc_ids", True),
}
# The backward from what the forward kept against the one that recomputes it: name -> (batch,
# seq_len, heads, d_k, d_v, gate, documents, input dtype).
KEPT_CASES = {
    "kept-fp32-doc-ids-fused": (2, 100, 1, 16, 16, "fused", "doc_ids", torch.float32),
    "kept-bf16-T100": (1, 100, 1, 32, 32, "random", None, torch.bfloat16),
}
FORWARD_KERNELS = ("gate_cumsum_kernel", "tile_products_kernel", "unit_lower_inverse_kernel",
                   "ut_transform_kernel", "state_scan_fwd_kernel")
BACKWARD_KERNELS = ("chunk_output_bwd_kernel", "state_scan_bwd_kernel", "state_terms_bwd_kernel",
                    "ut_transform_bwd_kernel", "tile_products_bwd_kernel",
                    "gate_cumsum_bwd_kernel")


def make_inputs(batch, seq_len, heads, d_k, d_v, gate, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, seq_len, heads, d_k)
    f64 = dict(generator=gen, dtype=torch.float64)
    q = F.normalize(torch.randn(shape, **f64), dim=-1)
    k = F.normalize(torch.randn(shape, **f64), dim=-1)
    v = torch.randn(batch, seq_len, heads, d_v, **f64)
    u = torch.rand(shape, **f64)
    g = {"pinned": torch.full(shape, G_MIN, dtype=torch.float64), "near_zero": -1e-3 * u,
         "random": G_MIN * u, "fused": 3 * torch.randn(shape, **f64)}[gate]
    beta = torch.rand(batch, seq_len, heads, **f64)
    h0 = torch.randn(batch, heads, d_k, d_v, **f64)
    gate_params = (0.5 * torch.randn(heads, **f64), torch.randn(heads * d_k, **f64))
    return q, k, v, g, beta, h0, gate_params


def documents(kind, batch, seq_len):
    if kind == "doc_ids":
        doc = torch.zeros(batch, seq_len, dtype=torch.long)
        doc[:, 37:] = 1  # starts inside the first chunk
        doc[0, 64:] = 2  # starts exactly at a chunk boundary
        doc[1, 70:] = 2
        return {"doc_ids": doc}, doc
    if kind == "cu_seqlens":
        # An empty document, one shorter than a 16-token tile, one across two chunk boundaries.
        cu = torch.tensor([0, 5, 5, 40, 140, 150])
        from titan_moe.ops.kda.varlen import doc_index_from_cu_seqlens

        return {"cu_seqlens": cu}, doc_index_from_cu_seqlens(cu, seq_len)[None]
    return {}, None


def run_case(batch, seq_len, heads, d_k, d_v, gate, doc_kind, with_states,
             dtype=torch.float32, segment=None) -> dict:
    """Triton op (q, k, v, g, beta in dtype) vs chunk_kda_torch (float64), outputs and
    gradients; with `segment`, by segments of that many tokens, also against the op run
    whole (`vs_whole`: the largest relative RMS difference over outputs and gradients), whose
    own report against float64 is `whole`."""
    import importlib

    from titan_moe.ops.kda import chunk_kda_torch, chunk_kda_triton, kda_gate

    chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")

    q, k, v, g, beta, h0, (A_log, dt_bias) = make_inputs(batch, seq_len, heads, d_k, d_v, gate)
    # The reference sees the values the op sees.
    q, k, v, g, beta = (x.to(dtype).double() for x in (q, k, v, g, beta))
    ref_docs, doc = documents(doc_kind, batch, seq_len)
    leaves = [q, k, v, g, beta] + ([h0] if with_states else [])
    fused = gate == "fused"
    if fused:
        leaves += [A_log, dt_bias]
    leaves = [x.requires_grad_() for x in leaves]
    initial = leaves[5] if with_states else None

    g_ref = kda_gate(leaves[3], leaves[-2], leaves[-1], G_MIN) if fused else leaves[3]
    o_ref, s_ref = chunk_kda_torch(*leaves[:3], g_ref, leaves[4], initial_state=initial,
                                   output_final_state=with_states, **ref_docs)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(o_ref.shape, generator=gen, dtype=torch.float64)
    loss_ref = (o_ref * do).sum()
    if with_states:
        ds = torch.randn(s_ref.shape, generator=gen, dtype=torch.float64)
        loss_ref = loss_ref + (s_ref * ds).sum()
    want = torch.autograd.grad(loss_ref, leaves)

    ours = [x.detach().to(dtype if i < 5 else torch.float32).requires_grad_()
            for i, x in enumerate(leaves)]
    gate_args = dict(A_log=ours[-2], dt_bias=ours[-1], g_min=G_MIN) if fused else {}
    def op():
        # An exp beyond fp32's range inside a kernel surfaces as a NumPy RuntimeWarning.
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            o, s = chunk_kda_triton(*ours[:5], initial_state=ours[5] if with_states else None,
                                    output_final_state=with_states, doc=doc, **gate_args)
            loss = (o.float() * do.float()).sum()
            if with_states:
                loss = loss + (s * ds.float()).sum()
            return o, s, torch.autograd.grad(loss, ours)

    whole = chunk_triton.SEGMENT
    chunk_triton.SEGMENT = segment or whole
    try:
        o, s, got = op()
    finally:
        chunk_triton.SEGMENT = whole
    names = list(GRADS[:5]) + (["initial_state"] if with_states else [])
    names += ["A_log", "dt_bias"] if fused else []

    def against_reference(o, s, got):
        report = {"o": rel_rms(o, o_ref), "o_dtype_ok": o.dtype == dtype}
        report["final_state"] = rel_rms(s, s_ref) if with_states else None
        report.update({f"d_{n}": rel_rms(a, b) for n, a, b in zip(names, got, want,
                                                                   strict=True)})
        return report

    report = against_reference(o, s, got)
    if segment:
        o_whole, s_whole, got_whole = op()
        pairs = [(o, o_whole), *zip(got, got_whole, strict=True)]
        pairs += [(s, s_whole)] if with_states else []
        report["vs_whole"] = max(rel_rms(a, b.double()) for a, b in pairs)
        report["whole"] = against_reference(o_whole, s_whole, got_whole)
    return report


def run_kept_vs_recomputed(batch, seq_len, heads, d_k, d_v, gate, doc_kind, dtype) -> dict:
    """Two backwards through one retained graph of the op: the first from the buffers the
    forward kept, the second (which finds them handed over) recomputing them with the same
    kernels; and the op under a non-reentrant checkpoint (its saved-tensor hooks: the kept
    buffers saved, dropped, recomputed). The kernels each backward launches, in order, and the
    gradients not bitwise equal to the first's."""
    import importlib

    from torch.utils.checkpoint import checkpoint

    from titan_moe.ops.kda import chunk_kda_triton

    chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")
    q, k, v, g, beta, h0, (A_log, dt_bias) = make_inputs(batch, seq_len, heads, d_k, d_v, gate)
    _, doc = documents(doc_kind, batch, seq_len)
    leaves = [x.to(dtype).requires_grad_() for x in (q, k, v, g, beta)]
    leaves.append(h0.float().requires_grad_())
    gate_args = {}
    if gate == "fused":
        gate_args = dict(A_log=A_log.float().requires_grad_(),
                         dt_bias=dt_bias.float().requires_grad_(), g_min=G_MIN)
    def op(*leaves):
        return chunk_kda_triton(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                doc=doc, **gate_args)

    o, s = op(*leaves)
    gen = torch.Generator().manual_seed(1)
    do, ds = torch.randn(o.shape, generator=gen).to(dtype), torch.randn(s.shape, generator=gen)
    inputs = leaves + list(gate_args.values())[:2]
    launches = {"kept": [], "recomputed": [], "checkpointed": []}
    real = chunk_triton.wrap_triton

    def recording(kernel):
        launches[backward].append(kernel.fn.__name__)
        return real(kernel)

    chunk_triton.wrap_triton = recording
    try:
        backward = "kept"
        kept = torch.autograd.grad((o, s), inputs, (do, ds), retain_graph=True)
        backward = "recomputed"
        recomputed = torch.autograd.grad((o, s), inputs, (do, ds))
        backward = "checkpointed"
        o, s = checkpoint(op, *leaves, use_reentrant=False)
        launches[backward].clear()  # the forward's own
        checkpointed = torch.autograd.grad((o, s), inputs, (do, ds))
    finally:
        chunk_triton.wrap_triton = real
    names = ["q", "k", "v", "g", "beta", "initial_state", "A_log", "dt_bias"][:len(inputs)]

    def unequal(grads):
        return [name for name, a, b in zip(names, kept, grads, strict=True)
                if not torch.equal(a, b)]

    return {**{f"{kind}_launches": kernels for kind, kernels in launches.items()},
            "unequal": unequal(recomputed), "checkpointed_unequal": unequal(checkpointed)}


def run_unreached_outputs(batch, seq_len, heads, d_k, d_v, gate) -> dict:
    """The op's backward with a loss on o alone, under ZeroFills (what autograd fills for the
    outputs without a gradient: the final state and the kept buffers); and with a loss on the
    final state alone (no dO) against the same loss given an explicit zero dO."""
    from tests.ops.zero_fills import ZeroFills
    from titan_moe.ops.kda import chunk_kda_triton

    q, k, v, g, beta, h0, _ = make_inputs(batch, seq_len, heads, d_k, d_v, gate)
    leaves = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v, g, beta)]
    leaves.append(h0.float().requires_grad_())

    def op():
        return chunk_kda_triton(*leaves[:5], initial_state=leaves[5], output_final_state=True)

    o, _ = op()
    with ZeroFills() as zeros:
        torch.autograd.grad(o.float().sum(), leaves)
    o, s = op()
    ds = torch.randn(s.shape, generator=torch.Generator().manual_seed(1))
    lone = torch.autograd.grad(s, leaves, ds)
    o, s = op()
    explicit = torch.autograd.grad((o, s), leaves, (torch.zeros_like(o), ds))
    names = ("q", "k", "v", "g", "beta", "initial_state")
    return {"fills": zeros.fills,
            "unequal": [n for n, a, b in zip(names, lone, explicit, strict=True)
                        if not torch.equal(a, b)]}


@triton.jit
def rounded(x, y, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(y + offs, round_to_bf16(tl.load(x + offs)))


def run_rounding() -> dict:
    """chunk_common.round_to_bf16 (the interpreter's stand-in for the GPU's round-to-nearest
    conversion) against torch's fp32 -> bf16, on random values of every scale, exact ties
    (lower 16 bits 0x8000, both parities, subnormals included), negatives, and values that round
    up to infinity."""
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(4096, generator=gen) * 10.0 ** torch.randint(-30, 30, (4096,),
                                                                    generator=gen)
    # The upper halves of finite fp32 values (exponent below 255: NaN payloads are not kept).
    bits = torch.randint(0, 0x7F80, (1024,), generator=gen, dtype=torch.int32) << 16
    ties = (bits | 0x8000).view(torch.float32)  # exactly halfway between two bf16 values
    specials = torch.tensor([3.4e38, -3.4e38, 0.0, -0.0] * 512)  # 8192 values: a power of two
    x = torch.cat([values, ties, -ties, specials])
    y = torch.empty_like(x)
    rounded[(1,)](x, y, N=x.numel())
    want = x.bfloat16().float()
    return {"n": x.numel(), "mismatches": int((y.view(torch.int32) != want.view(torch.int32))
                                              .sum()), "ties": ties.numel()}


def run_opcheck() -> dict:
    """torch.library.opcheck: the op's schema and autograd registration.

    The fake-tensor check runs on the GPU (tests/gpu/test_kda_triton_cuda.py): under the CPU
    interpreter Triton touches the fake tensors' storage.
    """
    from titan_moe.ops.kda.chunk_triton import chunk_kda_fwd

    q, k, v, g, beta, h0, _ = make_inputs(1, 80, 1, 16, 16, "random")
    args = [x.float().requires_grad_() for x in (q, k, v, g, beta)]
    args += [None, None, None, h0.float(), 16**-0.5, G_MIN, True, True]
    tests = ("test_schema", "test_autograd_registration")
    return {name: str(result) for name, result in
            torch.library.opcheck(chunk_kda_fwd, args, test_utils=tests).items()}


def test_backward_fills_no_gradient_for_outputs_the_loss_does_not_reach(results):
    """Autograd fills a zero gradient for every output of a custom op that gets none, unless
    its context turns that off; the op's kept buffers are outputs, so each was filled at the
    backward's start (2.5 GiB at 64K x 16 heads, measured 10.05 GiB against the 7.55 predicted).
    None is filled now, and a loss on the final state alone gives, bit for bit, the gradients of
    the same loss with an explicit zero dO."""
    report = results["unreached-outputs"]
    assert "error" not in report, report.get("error")
    assert report["fills"] == [], report["fills"]
    assert report["unequal"] == [], report


@pytest.mark.parametrize("name", CASES)
def test_op_matches_float64_reference(results, name):
    report = results[name]
    assert "error" not in report, report.get("error")
    assert report["o_dtype_ok"]
    errors = {key: value for key, value in report.items() if key != "o_dtype_ok"}
    for key, value in errors.items():
        if value is not None:
            assert value <= FP32_RTOL, (key, value)
    assert (report["final_state"] is None) == (not CASES[name][-1])


@pytest.mark.parametrize("name", BF16_CASES)
def test_bf16_op_matches_float64_reference(results, name):
    report = results[name]
    assert "error" not in report, report.get("error")
    assert report["o_dtype_ok"]
    assert report["o"] <= BF16_O_RTOL, report["o"]
    assert report["final_state"] <= BF16_O_RTOL, report["final_state"]
    grads = {key: value for key, value in report.items() if key.startswith("d_")}
    for key, value in grads.items():
        assert value <= BF16_GRAD_RTOL, (key, value)


@pytest.mark.parametrize("name", SEGMENT_CASES)
def test_op_by_segments_matches_the_whole_op_and_float64(results, name):
    report = results[name]
    assert "error" not in report, report.get("error")
    assert report["vs_whole"] <= SEGMENT_VS_WHOLE_RTOL, report["vs_whole"]
    bf16 = SEGMENT_CASES[name][1] == torch.bfloat16
    o_bound, grad_bound = (BF16_O_RTOL, BF16_GRAD_RTOL) if bf16 else (FP32_RTOL, FP32_RTOL)
    assert report["o"] <= o_bound, report
    assert (report["final_state"] or 0.0) <= o_bound, report
    grads = {key: value for key, value in report.items() if key.startswith("d_")}
    assert all(value <= grad_bound for value in grads.values()), grads


@pytest.mark.parametrize("name", KEPT_CASES)
def test_kept_backward_equals_the_recomputing_one_bit_for_bit(results, name):
    """The forward keeps G, W, K_d, the states and V~ besides the chunk matrices, so its
    backward launches only the backward kernels; the backward that recomputes them runs the
    forward's kernels on the same inputs, so the gradients are equal bit for bit, as they are
    under a checkpoint, whose hooks get the kept buffers saved."""
    report = results[name]
    assert "error" not in report, report.get("error")
    assert report["kept_launches"] == list(BACKWARD_KERNELS), report["kept_launches"]
    recomputed = report["recomputed_launches"]
    assert [n for n in recomputed if n in FORWARD_KERNELS] == list(FORWARD_KERNELS), recomputed
    assert [n for n in recomputed if n in BACKWARD_KERNELS] == list(BACKWARD_KERNELS), recomputed
    assert report["unequal"] == [], report
    # Under the checkpoint, its recompute (the whole forward), then the backward from the saved
    # buffers; bit for bit the same gradients.
    forward = [*FORWARD_KERNELS, "chunk_output_kernel"]
    assert report["checkpointed_launches"] == forward + list(BACKWARD_KERNELS), report
    assert report["checkpointed_unequal"] == [], report


def test_forward_and_backward_trace_with_fake_tensors():
    """The joint graph torch.compile's AOTAutograd traces (here make_fx on fake tensors, in this
    process: no kernel runs): the forward op with its kept outputs, then the three backward ops
    that take them, none recomputing. Fake shapes: bf16 inputs at T 200 (4 chunks), H 2,
    K = V = 64, as the op allocates them."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from titan_moe.ops.kda import chunk_kda_triton

    def step(q, k, v, g, beta, h0, A_log, dt_bias, do, ds):
        o, s = chunk_kda_triton(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                A_log=A_log, dt_bias=dt_bias, g_min=G_MIN)
        return torch.autograd.grad((o, s), (q, k, v, g, beta, h0, A_log, dt_bias), (do, ds))

    b, t, h, d = 1, 200, 2, 64
    bf16 = dict(dtype=torch.bfloat16)
    args = [torch.randn(b, t, h, d, **bf16).requires_grad_() for _ in range(4)]
    args += [torch.rand(b, t, h, **bf16), torch.randn(b, h, d, d), torch.zeros(h),
             torch.zeros(h * d)]
    args = args[:4] + [x.requires_grad_() for x in args[4:]]
    args += [torch.randn(b, t, h, d, **bf16), torch.randn(b, h, d, d)]
    graph = make_fx(step, tracing_mode="fake")(*args).graph
    calls = [node for node in graph.nodes if node.op == "call_function"
             and str(node.target).startswith("titan_moe.")]
    assert [str(node.target) for node in calls] == [
        "titan_moe.chunk_kda_fwd.default", "titan_moe.chunk_kda_bwd_states.default",
        "titan_moe.chunk_kda_bwd_state_terms.default", "titan_moe.chunk_kda_bwd_intra.default"]
    outputs = sorted((node for node in graph.nodes if node.op == "call_function"
                      and node.args and node.args[0] is calls[0]), key=lambda node: node.args[1])
    kept = outputs[2:]
    assert [node.args[1] for node in kept] == list(range(2, 10))
    assert all(set(node.users) & set(calls[1:]) for node in kept)  # each read by a backward op
    f32, bf = torch.float32, torch.bfloat16
    want = [((1, 256, 2, 64), f32)] * 4 + [((1, 256, 2, 64), bf)] * 2 + [
        ((1, 4, 2, 64, 64), bf), ((1, 256, 2, 64), bf)]
    assert [(tuple(node.meta["val"].shape), node.meta["val"].dtype) for node in kept] == want


@pytest.mark.parametrize("hooked", [False, True], ids=["plain", "saved-tensor-hooks"])
def test_kept_buffers_reach_the_backward_through_saved_tensor_hooks(hooked):
    """Activation checkpointing and offloading act through saved-tensor hooks, which see only
    saved tensors. Under such hooks the forward saves its kept buffers (a checkpoint then drops
    them until its recompute); without, it hands them over on the autograd context, unsaved.
    Either way the backward launches none of the forward's kernels. Launches are recorded, not
    run (no values are compared here: the interpreted cases above do that)."""
    import importlib

    from titan_moe.ops.kda import chunk_kda_triton

    chunk_triton = importlib.import_module("titan_moe.ops.kda.chunk_triton")
    launches = []

    def recording(kernel):
        def launch(*args, **kwargs):
            launches.append(kernel.fn.__name__)

        return type("Grid", (), {"__getitem__": lambda self, grid: launch})()

    leaves = [torch.zeros(1, 128, 1, 16).requires_grad_() for _ in range(4)]
    leaves.append(torch.zeros(1, 128, 1).requires_grad_())
    packed = []

    def pack(x):
        packed.append(x)
        return x

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x)
    real = chunk_triton.wrap_triton
    chunk_triton.wrap_triton = recording
    try:
        if hooked:
            with hooks:
                o, _ = chunk_kda_triton(*leaves)
        else:
            o, _ = chunk_kda_triton(*leaves)
        launches.clear()
        torch.autograd.grad(o, leaves, torch.zeros_like(o))
    finally:
        chunk_triton.wrap_triton = real
    assert launches == list(BACKWARD_KERNELS), launches
    # The inputs, and under hooks the eight kept buffers (states [1, 2, 1, 16, 16]).
    assert len(packed) == (5 + 8 if hooked else 0)
    if hooked:
        assert tuple(packed[-2].shape) == (1, 2, 1, 16, 16)


def test_round_to_bf16_matches_torchs_round_to_nearest_even(results):
    report = results["round_to_bf16"]
    assert "error" not in report, report.get("error")
    assert report["n"] == 8192 and report["ties"] == 1024
    assert report["mismatches"] == 0, report


def test_opcheck_schema_and_autograd(results):
    report = results["opcheck"]
    assert "error" not in report, report.get("error")
    assert set(report.values()) == {"SUCCESS"}, report


if __name__ == "__main__":
    reports = {name: guarded(run_case, *case, dtype, segment)
               for name, (case, dtype, segment) in SEGMENT_CASES.items()}
    # A case run whole as part of a segment case reports from there (its error, if it failed).
    run_whole = {case: reports[name].get("whole", reports[name])
                 for name, (case, dtype, _) in SEGMENT_CASES.items() if dtype == torch.float32}
    reports |= {name: run_whole[case] if case in run_whole else guarded(run_case, *case)
                for name, case in CASES.items()}
    reports |= {name: guarded(run_case, *case, torch.bfloat16) for name, case in BF16_CASES.items()}
    reports |= {name: guarded(run_kept_vs_recomputed, *case) for name, case in KEPT_CASES.items()}
    reports["unreached-outputs"] = guarded(run_unreached_outputs, 1, 100, 1, 32, 32, "random")
    reports["round_to_bf16"] = guarded(run_rounding)
    print(json.dumps({**reports, "opcheck": guarded(run_opcheck)}))
