"""Vision settings are checked at the boundary: one clear error naming the field."""

import dataclasses

import pytest
import torch

from titan_moe.model.args import VISION_FLAVORS, ConfigError, get_flavor
from titan_moe.model.flops import count_params
from titan_moe.model.model import TitanMoE
from titan_moe.train.config import parse_job_config

MM = ["--job.config_file", "configs/debug_mm.toml", "--training.device", "cpu"]


@pytest.mark.parametrize("argv, message", [
    (["--titan_moe.vision", "huge"], r"titan_moe.vision = 'huge': allowed: none, debug, proxy"),
    (["--titan_moe.vision", "none"], r"training.image_data / multimodal_eval.freq need a vision"),
    (["--titan_moe.vision_max_patches", "30"], r"vision_max_patches = 30: .*multiple of 4"),
    (["--titan_moe.vision_max_patches", "1024", "--training.seq_len", "192"],
     r"258 tokens, more than training.seq_len = 192"),
    (["--titan_moe.vision_window_patches", "32"], r"vision_window_patches = 32: .*>= "
                                                   r"vision_max_patches = 64"),
    (["--training.image_data", "/no/such/images.jsonl"], r"training.image_data=.*no such"),
    (["--training.image_docs_per_text_doc", "0"], r"image_docs_per_text_doc must be >= 1"),
    (["--multimodal_eval.images", "180"], r"multimodal_eval.images = 180: there are only 179"),
])
def test_bad_vision_settings_name_the_field(argv, message):
    with pytest.raises(ConfigError, match=message):
        parse_job_config(MM + argv)


def test_debug_mm_config_parses():
    job_config = parse_job_config(MM)
    assert job_config.titan_moe.vision == "debug" and job_config.training.image_data == "digits"


def test_full_tower_is_about_0_4b_parameters():
    args = dataclasses.replace(get_flavor("debug"), vision="full").validate()
    with torch.device("meta"):
        tower = TitanMoE(args).vision
    vit = sum(p.numel() for n, p in tower.named_parameters() if not n.startswith("projector"))
    assert 0.38e9 < vit < 0.43e9  # the ViT itself; the projector adds 4·1152 → d
    assert VISION_FLAVORS["full"].dim == 1152


def test_vision_parameters_are_not_counted_per_token():
    args = dataclasses.replace(get_flavor("debug"), vision="debug").validate()
    text = dataclasses.replace(args, vision="none")
    with torch.device("meta"):
        mm, plain = count_params(TitanMoE(args), args), count_params(TitanMoE(text), text)
    assert mm.active == plain.active and mm.total == plain.total + mm.vision > plain.total
