"""Which tensors Inductor believes each of our Triton kernels writes: exactly its outputs.

Inductor reads a user kernel's TTIR to find the tensors it stores to, following each store's
pointer back through every value it was computed from, across calls into helper functions. A
helper that takes pointers and also returns offsets makes every pointer it took look written:
Inductor then clones those inputs before each launch, and a CUDA-graphed region whose input
(doc ids, say) a kernel "writes" is not graphed at all (seen on the H200, 2026-12-04, with the
short conv's tile helper). Each op here runs on CPU with its launches recorded instead of run,
and Inductor's own analysis reads each launched kernel's TTIR for an sm_90 target (no GPU is
needed to make TTIR); the writes it finds are compared with the kernel's output arguments.
"""

import importlib
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

from bench.triton_static import recorded_launches

# Inductor's analysis as torch 2.13 names it (CI's torch); torch 2.11 (the GPU machine) has no
# such function, and there this CPU test has nothing to check.
identify_accessed_tensors = pytest.importorskip(
    "torch._higher_order_ops.triton_kernel_wrap").__dict__.get("identify_accessed_tensors")
if identify_accessed_tensors is None:
    pytest.skip("torch without triton_kernel_wrap.identify_accessed_tensors",
                allow_module_level=True)


class _Hopper:
    """The one driver method making TTIR needs: the target to lower for."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)


@pytest.fixture(autouse=True)
def hopper_target():
    # Put back as found: reset_active would look for a GPU driver, which a CPU host lacks.
    before = driver._active
    driver.set_active(_Hopper())
    yield
    driver._active = before


def written(module_name: str, call: Callable) -> dict[str, set[str]]:
    """kernel name -> the argument names Inductor finds written, for each launch `call` makes."""
    module = importlib.import_module(module_name)
    found = {}
    for kernel, _, args, options in recorded_launches(module, lambda: call(module)):
        # The leading arguments come positionally, the rest (constexprs, options) by name.
        bound = dict(zip(kernel.arg_names, args, strict=False)) | options
        kwargs = {k: v for k, v in bound.items() if k in kernel.arg_names}
        accesses = identify_accessed_tensors(kernel, kwargs, {})
        writes = {dep.name for dep in accesses.read_writes.writes}
        # Compiled, each written argument is cloned and written back on its own: one tensor
        # passed as two written arguments comes back with only the last one's writes.
        storages = [kwargs[name].untyped_storage().data_ptr() for name in writes]
        assert len(set(storages)) == len(storages), (kernel.fn.__name__, sorted(writes))
        found[kernel.fn.__name__] = writes
    return found


def test_short_conv_kernels_write_only_their_outputs():
    x, w = torch.randn(2, 128, 256), torch.randn(256, 4)
    doc = torch.zeros(2, 128, dtype=torch.int32)
    got = written("titan_moe.ops.short_conv.short_conv_triton",
                  lambda m: (m.short_conv_triton(x, w, doc, 64),
                             m.short_conv_bwd_triton(x, x, w, doc, 64)))
    assert got == {"short_conv_fwd_kernel": {"y_ptr"}, "short_conv_bwd_dz_kernel": {"dz_ptr"},
                   "short_conv_bwd_dx_kernel": {"dx_ptr", "dw_ptr"}}


def test_attn_res_kernels_write_only_their_outputs():
    sources = [torch.randn(256, 256), torch.randn(256, 256).bfloat16(),
               torch.randn(256, 256).bfloat16()]
    query, gain = torch.randn(256), torch.ones(256)

    def run(m):
        m.attn_res_fwd(sources, query, gain, 1e-6, torch.float32)
        m.attn_res_bwd(sources, torch.empty(3, 3, 256), query, torch.randn(256, 256))

    got = written("titan_moe.ops.attn_res.attn_res_triton", run)
    assert got == {"attn_res_fwd_kernel": {"out_ptr", "stats_ptr"},
                   "attn_res_bwd_kernel": {"d0", "d1", "d2", "du_ptr"}}


def test_router_kernel_writes_only_its_outputs(monkeypatch):
    got = written("titan_moe.ops.router.qb_route_triton",
                  lambda m: m.qb_route_triton(torch.randn(64, 16), torch.zeros(16), None, 2, 1.0,
                                              32, True))
    assert got == {"qb_route_kernel": {"ids_ptr", "weights_ptr", "hist_ptr", "load_ptr"}}
    # Launches are recorded, not run: there are no cutoffs for count_bins to count.
    monkeypatch.setattr(importlib.import_module("titan_moe.ops.router.qb_route_triton"),
                        "count_bins", lambda logits, bias, alpha, n_bins: None)
    shared = written("titan_moe.ops.router.qb_route_triton",
                     lambda m: m.launch_qb_route(torch.randn(64, 16), torch.zeros(16), None, 2,
                                                 1.0, 32, True, counting="shared"))
    assert shared == {"qb_route_kernel": {"ids_ptr", "weights_ptr", "alpha_ptr", "load_ptr"}}


def test_kda_kernels_write_only_their_outputs():
    q = torch.randn(1, 128, 2, 64).bfloat16()
    g, beta = -torch.rand(1, 128, 2, 64), torch.rand(1, 128, 2)
    doc = torch.zeros(1, 128, dtype=torch.int32)

    def run(m):
        _, _, *kept = m.chunk_kda_fwd(q, q, q, g, beta, doc, None, None, None, 0.125, -5.0, True,
                                      True)
        ctx = SimpleNamespace(saved_tensors=(q, q, q, g, beta, doc, None, None, None), kept=kept,
                              scale=0.125, g_min=-5.0)
        return m._backward(ctx, q, None)

    got = written("titan_moe.ops.kda.chunk_triton", run)
    # The backward runs from the buffers the forward kept: the forward's kernels launch once,
    # the scan storing the final state asked for.
    assert got == {"gate_cumsum_kernel": {"G_out"}, "tile_products_kernel": {"A_qk", "KK"},
                   "unit_lower_inverse_kernel": {"Tinv"}, "ut_transform_kernel": {"W", "U", "K_d"},
                   "state_scan_fwd_kernel": {"h_states", "v_new", "final_state"},
                   "chunk_output_kernel": {"o"},
                   "chunk_output_bwd_kernel": {"dh_states", "dv_new"},
                   "state_scan_bwd_kernel": {"dh_states", "dv_new"},
                   "state_terms_bwd_kernel": {"d_qg", "d_w", "d_kd", "d_gamma"},
                   "ut_transform_bwd_kernel": {"dv", "dbeta", "dA", "dP", "d_w"},
                   "tile_products_bwd_kernel": {"dq", "dk", "dG", "d_end_parts"},
                   "gate_cumsum_bwd_kernel": {"dg"}}


def test_mla_decode_kernel_writes_only_its_outputs():
    got = written("titan_moe.ops.mla_decode",
                  lambda m: m.mla_decode_triton(torch.randn(2, 4, 96), torch.randn(2, 64, 96),
                                                torch.ones(2, 64, dtype=torch.bool),
                                                torch.zeros(2, dtype=torch.int64), 0.1, 64))
    assert got == {"mla_decode_split_kernel": {"m_ptr", "l_ptr", "acc_ptr"}}


def test_moe_dispatch_kernels_write_only_their_outputs():
    dest = torch.arange(64)
    src = torch.cat([dest, torch.full((16,), -1)])
    weights = torch.rand(16, 4)

    def run(m):
        m.moe_dispatch_triton(torch.randn(16, 256), dest, src, 4)
        m.moe_combine_triton(torch.randn(80, 256), dest, src, weights)
        m.moe_combine_bwd_triton(torch.randn(16, 256), torch.randn(80, 256), dest, src, weights)

    got = written("titan_moe.ops.moe_dispatch.moe_dispatch_triton", run)
    assert got == {"scatter_rows_kernel": {"out_ptr"}, "gather_sum_rows_kernel": {"out_ptr"},
                   "combine_bwd_kernel": {"drows_ptr", "dw_ptr"}}


def test_situ_glu_kernels_write_only_their_outputs_each_through_one_argument():
    a, b = torch.randn(64, 96), torch.randn(64, 96)
    ab = torch.cat([a, b], dim=-1)
    module = "titan_moe.ops.situ_glu.situ_glu_triton"
    separate = written(module, lambda m: (m.situ_glu_triton(a, b, 4.0, 25.0),
                                          m.situ_glu_bwd_triton(a, a, b, 4.0, 25.0)))
    assert separate == {"situ_glu_fwd_kernel": {"h_ptr"},
                        "situ_glu_bwd_kernel": {"da_ptr", "db_ptr"}}
    # Packed, [∂a | ∂b] is one tensor: the kernel writes both halves through da_ptr.
    packed = written(module, lambda m: (m.situ_glu_packed_triton(ab, 4.0, 25.0),
                                        m.situ_glu_packed_bwd_triton(a, ab, 4.0, 25.0)))
    assert packed == {"situ_glu_fwd_kernel": {"h_ptr"}, "situ_glu_bwd_kernel": {"da_ptr"}}


def test_dispatch_layout_kernels_write_only_their_outputs():
    pair_expert = torch.tensor([3, 0, 3, 1, 0, 3])
    got = written("titan_moe.ops.moe_dispatch.layout_triton",
                  lambda m: m.dispatch_layout_triton(pair_expert, 4, 8, 32))
    assert got == {"block_ranks_kernel": {"counts_ptr", "rank_ptr"},
                   "group_starts_kernel": {"counts_ptr", "start_ptr", "offs_ptr", "src_ptr"},
                   "pair_rows_kernel": {"dest_ptr", "src_ptr"}}
