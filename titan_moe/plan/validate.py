"""The plan checked on a GPU: a config trained for a few steps on one CUDA GPU under FSDP2, its
measured peak set against the plan's (`estimate` at one GPU; the target: within 0.85 .. 1.15)."""

from dataclasses import asdict

import torch

from titan_moe.model.model import TitanMoE
from titan_moe.parallel.parallelize import OP_SAC_SAVE_LIST, apply_fsdp
from titan_moe.plan.config import PlanConfig
from titan_moe.plan.memory import GB, estimate


def validate(cfg: PlanConfig, steps: int) -> dict:
    """Train `steps` steps of the config on one CUDA GPU under FSDP2 (a one-rank mesh, so the
    memory follows the cluster's plan) and compare the measured peak with estimate(gpus=1)."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.config import ActivationCheckpoint
    from torchtitan.distributed.activation_checkpoint import apply_ac

    if not torch.cuda.is_available():
        raise SystemExit("error: --validate needs a CUDA GPU")
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("fsdp",))
    with torch.device("meta"):
        model = TitanMoE(cfg.args)
    if cfg.ac_mode != "none":
        ac = ActivationCheckpoint(mode=cfg.ac_mode, selective_ac_option=cfg.selective_ac_option)
        apply_ac(model, ac, op_sac_save_list=OP_SAC_SAVE_LIST)
    apply_fsdp(model, mesh, torch.bfloat16, torch.float32)
    model.to_empty(device="cuda")
    with torch.no_grad():
        model.init_weights()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(cfg.args.vocab_size, (cfg.local_batch, cfg.seq_len + 1), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        del logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    dist.destroy_process_group()
    planned = estimate(cfg, 1, 1)
    result = {"measured_gb": measured / GB, "planned_gb": planned.peak / GB,
              "ratio": planned.peak / measured, "plan": asdict(planned), "steps": steps}
    print(f"measured peak {measured / GB:.2f} GB, planned {planned.peak / GB:.2f} GB, "
          f"planned / measured = {result['ratio']:.3f} (target within 0.85 .. 1.15)")
    return result
