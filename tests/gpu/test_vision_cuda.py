"""The vision tower on CUDA (`pytest -m gpu`): bf16 compiled vs eager, and the multimodal proxy
forward + backward with the proxy tower through the fused SDPA kernels with a block mask."""

import dataclasses

import pytest
import torch

from tests.gpu.bf16_tolerance import BF16_RTOL
from tests.metrics import rel_max
from titan_moe.model.args import VISION_FLAVORS, get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.model.vision import VisionTower

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _slots(n_slots: int, images: list[int], grid: int = 32):
    """Patch slot inputs for images of the given patch counts (multiples of 4), then padding."""
    g = torch.Generator().manual_seed(0)
    image = torch.full((1, n_slots), -1)
    offset = 0
    for i, n in enumerate(images):
        image[0, offset : offset + n] = i
        offset += n
    patches = torch.randn(1, n_slots, 3 * 14 * 14, generator=g)
    pos = torch.randint(0, grid, (1, n_slots, 2), generator=g)
    return patches.cuda(), pos.cuda(), image.cuda()


def test_proxy_tower_bf16_compiled_matches_eager():
    torch.manual_seed(0)
    vision = VISION_FLAVORS["proxy"]
    tower = VisionTower(vision, out_dim=2048).cuda()
    tower.init_weights(0.02)
    tower = tower.to(torch.bfloat16)
    patches, pos, image = _slots(vision.window_patches, [1024, 256, 512, 64])
    patches = patches.bfloat16()
    # The loss projects the output on a fixed random direction. mean(out²) would not do: the
    # tower ends in an RMSNorm, whose output's mean square is 1 whatever its input, so that
    # loss's gradient is only the eps term (700x smaller than this one, measured on the debug
    # tower in fp32) and in bf16 it is rounding noise (eager and compiled differed by 127%).
    shape = (1, vision.window_patches // tower.group, 2048)
    direction = torch.randn(shape, generator=torch.Generator().manual_seed(1)).cuda()
    eager = tower(patches, pos, image)
    (eager.float() * direction).mean().backward()
    grad = tower.patch_embed.weight.grad.clone()
    tower.zero_grad(set_to_none=True)
    out = torch.compile(tower, fullgraph=True)(patches, pos, image)
    (out.float() * direction).mean().backward()
    assert rel_max(out, eager) < BF16_RTOL
    assert rel_max(tower.patch_embed.weight.grad, grad) < BF16_RTOL


def test_multimodal_debug_model_trains_the_tower_on_cuda():
    args = dataclasses.replace(get_flavor("debug"), vision="debug", max_seq_len=256).validate()
    torch.manual_seed(0)
    model = TitanMoE(args).cuda()
    model.init_weights()
    patches, pos, image = _slots(64, [16, 32])
    tokens = torch.randint(10, 4000, (1, 256), device="cuda")
    tokens[0, 10:14], tokens[0, 100:108] = 3, 3
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(tokens, None, patches, pos, image)
    logits.float().logsumexp(-1).mean().backward()
    for name, p in model.vision.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
