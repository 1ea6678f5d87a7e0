"""The vision tower, eager vs torch.compile(fullgraph=True) with our passes on, float32 on CPU:
forward and the gradients of the patches and the patch embedding."""

import dataclasses

import torch

from compile_passes.registry import PASS_NAMES, inductor_options
from tests.scalar_cpp import SCALAR_CPP
from titan_moe.model.args import VISION_FLAVORS
from titan_moe.model.vision import VisionTower

RTOL = ATOL = 1e-4  # fp32 reassociation through one ViT block, the merge and the projector


def test_vision_tower_eager_matches_compiled():
    # One small block keeps the cold compile of forward + backward short.
    vision = dataclasses.replace(VISION_FLAVORS["debug"], dim=32, n_layers=1,
                                 mlp_hidden=64).validate()
    torch.manual_seed(0)
    tower = VisionTower(vision, out_dim=32)
    tower.init_weights(0.02)
    g = torch.Generator().manual_seed(1)
    p = vision.window_patches
    patches = torch.randn(2, p, 3 * 14 * 14, generator=g)
    pos = torch.randint(0, 6, (2, p, 2), generator=g)
    image = torch.full((2, p), -1)  # two images in row 0, one in row 1, padding slots after
    image[0, :16], image[0, 16:40], image[1, :8] = 0, 1, 0
    compiled = torch.compile(tower, fullgraph=True,
                             options=inductor_options(PASS_NAMES) | SCALAR_CPP)
    outs, grads = [], []
    for fn in (tower, compiled):
        x = patches.clone().requires_grad_()
        out = fn(x, pos, image)
        out.square().sum().backward()
        outs.append(out.detach())
        grads.append((x.grad, tower.patch_embed.weight.grad.clone()))
        tower.zero_grad()
    assert outs[0].shape == (2, p // 4, 32)
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=RTOL)
    for a, b in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL)
