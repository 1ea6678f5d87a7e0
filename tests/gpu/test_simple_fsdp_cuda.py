"""SimpleFSDP compiled with Inductor's bucketing passes vs FSDP2 on one CUDA GPU (`pytest -m gpu`).

One-rank meshes: the collectives are real NCCL calls on one rank, so the passes run and the
math is that of any rank count. Same weights, same batch, 5 AdamW steps in fp32 parameters:
the losses agree within rtol 1e-4 (Inductor fuses and reorders fp32 arithmetic; a wrong
gradient reduction moves them by > 1e-2). Step times are printed, not asserted (bench/ job).
"""

import os
import time

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

LOSS_RTOL = 1e-4


@pytest.fixture(scope="module")
def mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    if not dist.is_initialized():
        dist.init_process_group("nccl", rank=0, world_size=1)
    yield init_device_mesh("cuda", (1,), mesh_dim_names=("fsdp",))


def _train(model, steps: int = 5) -> tuple[list[float], float]:
    import torch.nn.functional as F

    from tests.distributed.harness import global_batch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    batch = global_batch(128)[0].cuda()
    losses, start = [], 0.0
    for step in range(steps):
        if step == 1:
            torch.cuda.synchronize()
            start = time.perf_counter()
        loss = F.cross_entropy(model(batch[:, :-1]).float().flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch.cuda.synchronize()
    return losses, (time.perf_counter() - start) / (steps - 1)


@pytest.mark.parametrize("passes", ["none", "auto_bucketing", "transformer_block_bucketing"])
def test_compiled_simple_fsdp_matches_fsdp2(mesh, passes):
    from tests.distributed.harness import build_model
    from titan_moe.parallel.parallelize import apply_fsdp
    from titan_moe.parallel.simple_fsdp import compile_simple_fsdp, shard_simple_fsdp

    fsdp2 = build_model().cuda()
    apply_fsdp(fsdp2, mesh, torch.float32, torch.float32)
    want, fsdp2_s = _train(fsdp2)
    simple = shard_simple_fsdp(build_model().cuda(), mesh, "fully_shard", torch.float32,
                               torch.float32)
    got, simple_s = _train(compile_simple_fsdp(simple, "inductor", passes, reshard=True))
    print(f"passes={passes}: FSDP2 eager {fsdp2_s * 1e3:.1f} ms/step, "
          f"SimpleFSDP compiled {simple_s * 1e3:.1f} ms/step")
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=LOSS_RTOL, atol=0)
