"""The modules kept in fp32 under mixed-precision sharding (spec §2, §5): the AttnRes
queries/gains, the router and every RMSNorm. FSDP2 (parallelize.py) and SimpleFSDP
(simple_fsdp.py) give each its own unit with an fp32 policy, so mixed_precision_param = bf16
never rounds them.
"""

import torch
import torch.nn as nn

from titan_moe.model.attn_res import AttnResSite
from titan_moe.model.router import Router

FP32_MODULES = (AttnResSite, Router, nn.RMSNorm)


def fp32_islands(shard: bool, param_dtype: torch.dtype) -> bool:
    """Whether the fp32 modules need their own FSDP units: only when sharding casts parameters."""
    return shard and param_dtype != torch.float32
