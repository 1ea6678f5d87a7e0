"""The TOML [compile] switch for our passes: defaults, bad values, and the passes firing (or not)
in a compiled debug training step built the way the trainer builds it (parse_job_config ->
parallelize_titan_moe -> forward, cross entropy, backward, AdamW step)."""

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torchtitan.distributed import ParallelDims

from compile_passes.registry import PASS_NAMES, matched_counts
from tests.scalar_cpp import scalar_cpp
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.parallelize import parallelize_titan_moe
from titan_moe.train.config import ConfigError, parse_job_config

# One dense Gated-MLA layer at toy width: a SiTU-GLU MLP and an AttnRes site inside the compiled
# layer (MLA, not KDA: its graph compiles several times faster; tests/parity sees kda_gate fire).
TINY_DEBUG = """
[model]
flavor = "debug"
[training]
seq_len = 64
[compile]
enable = true
{compile}
[titan_moe]
dim = 32
vocab_size = 64
n_layers = 1
mla_layers = [1]
n_dense_layers = 1
head_dim = 16
kda_gate_rank = 8
q_lora_rank = 16
kv_lora_rank = 16
qk_nope_head_dim = 16
qk_rope_head_dim = 8
v_head_dim = 16
dense_hidden = 32
"""


@pytest.fixture(autouse=True)
def one_process(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.setenv("NGPU", "1")


def _config(tmp_path: Path, compile_lines: str = "", cli: tuple[str, ...] = ()):
    path = tmp_path / "job.toml"
    path.write_text(TINY_DEBUG.format(compile=compile_lines))
    return parse_job_config(["--job.config_file", str(path), *cli])


def _error(tmp_path: Path, compile_lines: str = "", cli: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as info:
        _config(tmp_path, compile_lines, cli)
    return str(info.value)


def test_passes_are_on_by_default_with_fullgraph():
    config = parse_job_config([])
    assert config.compile.passes == list(PASS_NAMES)
    assert config.compile.fullgraph is True


def test_passes_switch_off_from_the_toml_and_the_cli(tmp_path):
    assert _config(tmp_path, "passes = []").compile.passes == []
    assert _config(tmp_path, cli=("--compile.passes", "")).compile.passes == []
    chosen = _config(tmp_path, cli=("--compile.passes", "situ_glu,attn_res"))
    assert chosen.compile.passes == ["situ_glu", "attn_res"]
    assert _config(tmp_path, "fullgraph = false").compile.fullgraph is False


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        ('passes = ["fuse_all"]',
         "compile.passes: unknown pass 'fuse_all'; allowed: situ_glu, attn_res, kda_gate"),
        ('passes = ["situ_glu", "situ_glu"]', "compile.passes: a pass is listed twice"),
        ('passes = "situ_glu"', "compile.passes: expected a list of str, got 'situ_glu'"),
        ('fullgraph = "yes"', "compile.fullgraph: expected bool, got 'yes'"),
        ('backend = "aot_eager"',
         "compile.passes ['situ_glu', 'attn_res', 'kda_gate'] are Inductor passes but "
         "compile.backend is 'aot_eager'; allowed with passes: 'inductor'"),
        ('backend = "aot_eager"\npasses = []\ncudagraphs = true',
         "compile.cudagraphs needs compile.backend = 'inductor', got 'aot_eager'"),
        ("cudagraphs = 1", "compile.cudagraphs: expected bool, got 1"),
        ('inductor = ["combo_kernel=true"]',
         "compile.inductor: 'combo_kernel=true': give KEY=VALUE with KEY an option of "
         "torch._inductor.config"),
        ('inductor = ["combo_kernels=1"]',
         "compile.inductor: 'combo_kernels=1': combo_kernels takes a bool (default False)"),
        ('backend = "aot_eager"\npasses = []\ninductor = ["combo_kernels=true"]',
         "compile.inductor ['combo_kernels=true'] are Inductor options but compile.backend is "
         "'aot_eager'; allowed with them: 'inductor'"),
    ],
)
def test_bad_compile_values_name_the_field_and_what_is_allowed(tmp_path, lines, message):
    assert message in _error(tmp_path, lines)


def test_other_backends_are_allowed_without_passes(tmp_path):
    config = _config(tmp_path, 'backend = "aot_eager"\npasses = []')
    assert config.compile.backend == "aot_eager"


def _compiled_training_step(tmp_path: Path, compile_lines: str) -> dict[str, int]:
    config = _config(tmp_path, compile_lines)
    args = get_flavor(config.model.flavor)
    args.update_from_config(config)
    torch.manual_seed(0)
    model = TitanMoE(args)
    model.init_weights()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    model = parallelize_titan_moe(model, dims, config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, args.vocab_size, (2, config.training.seq_len + 1))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # A cache hit would replay an earlier compile without running the passes.
    with (
        scalar_cpp(fx_graph_cache=False),
        torch._functorch.config.patch(enable_autograd_cache=False),
    ):
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
    optimizer.step()
    return matched_counts()


def test_passes_fire_in_a_compiled_training_step(tmp_path):
    on = _compiled_training_step(tmp_path, "")
    # The layer holds one dense SiTU-GLU and one AttnRes site (the FFN's); no KDA gate.
    assert on["situ_glu"] >= 1 and on["attn_res"] >= 1 and on["kda_gate"] == 0, on



def test_passes_off_compile_without_our_post_pass(tmp_path, monkeypatch):
    # What `passes = []` must change is the options every per-layer compile gets; recording them
    # checks that without a second cold compile (the firing itself is checked above).
    seen = []

    def record(module, **kwargs):
        seen.append(kwargs)
        return module

    monkeypatch.setattr(torch, "compile", record)
    counts = _compiled_training_step(tmp_path, "passes = []")
    assert seen and all(kw["options"] is None and kw["fullgraph"] for kw in seen), seen
    assert counts == dict.fromkeys(PASS_NAMES, 0), counts


def test_inductor_options_reach_every_compile_beside_the_passes(tmp_path, monkeypatch):
    """`compile.inductor` (empty by default) adds its options to each compile's; recorded
    without compiling. Refused with simple_fsdp, whose compile is torchtitan's backend."""
    assert parse_job_config([]).compile.inductor == []
    seen = []

    def record(target, **kwargs):
        seen.append(kwargs["options"])
        return target

    monkeypatch.setattr(torch, "compile", record)
    config = _config(tmp_path, cli=("--compile.inductor", "combo_kernels=true,cpp_wrapper=true"))
    assert config.compile.inductor == ["combo_kernels=true", "cpp_wrapper=true"]
    args = get_flavor(config.model.flavor)
    args.update_from_config(config)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    parallelize_titan_moe(TitanMoE(args), dims, config)
    assert seen and all(options["combo_kernels"] is True and options["cpp_wrapper"] is True
                        and "joint_custom_post_pass" in options for options in seen), seen
    message = _error(tmp_path, 'inductor = ["combo_kernels=true"]',
                     ("--parallelism.sharding", "simple_fsdp"))
    assert "compile.inductor with parallelism.sharding = 'simple_fsdp' is not supported" in message


def test_cudagraphs_are_off_by_default_and_refused_with_cp_checkpointing_and_segments(tmp_path):
    assert parse_job_config([]).compile.cudagraphs is False
    no_ac = ("--activation_checkpoint.mode", "none")
    assert _config(tmp_path, "cudagraphs = true", no_ac).compile.cudagraphs is True
    message = _error(tmp_path, "cudagraphs = true",
                     ("--parallelism.context_parallel_degree", "2", *no_ac))
    assert "compile.cudagraphs with parallelism.context_parallel_degree > 1" in message
    message = _error(tmp_path, "cudagraphs = true", ("--activation_checkpoint.mode", "full"))
    assert "compile.cudagraphs with activation_checkpoint.mode = 'full' is not supported" in message
    message = _error(tmp_path, "cudagraphs = true", ("--titan_moe.seq_segment", "64", *no_ac))
    assert "compile.cudagraphs with titan_moe.seq_segment > 0 is not supported" in message


def test_cudagraphs_graph_every_region_and_give_the_mixers_the_static_layout(tmp_path,
                                                                           monkeypatch):
    """What `cudagraphs = true` changes is each compile's options and the mixers' document
    layout; recorded without compiling (the graphs run in tests/gpu/test_cudagraphs_cuda.py)."""
    seen = []

    def record(target, **kwargs):
        module = getattr(target, "__self__", target)
        seen.append((type(module).__name__, kwargs["options"]))
        return target

    monkeypatch.setattr(torch, "compile", record)
    config = _config(tmp_path, "cudagraphs = true\npasses = []",
                     ("--titan_moe.n_layers", "2", "--titan_moe.mla_layers", "2",
                      "--activation_checkpoint.mode", "none"))
    args = get_flavor(config.model.flavor)
    args.update_from_config(config)
    model = TitanMoE(args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    parallelize_titan_moe(model, dims, config)
    graphed = {name: options == {"triton.cudagraphs": True} for name, options in seen}
    # "function": the residual add, compiled once and given to every layer.
    assert graphed == {"AttnResSite": True, "RMSNorm": True, "KimiDeltaAttention": True,
                       "GatedMLA": True, "SiTUGLU": True, "LatentMoE": True, "Embedding": True,
                       "function": True}, seen
    assert model.layers["0"].mixer.sequence_recurrence.keywords == {"static_layout": True}
    assert model.layers["1"].mixer.attention.keywords == {"static_layout": True}
    assert model.layers["0"].residual_add is model.layers["1"].residual_add is not torch.add
