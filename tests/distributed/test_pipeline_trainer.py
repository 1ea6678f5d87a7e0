"""The trainer under pipeline parallelism, gloo on CPU, against one process: 5 steps of a 4-layer
model (AttnRes blocks of 2; layer 0 dense, layers 1-3 MoE) from one seed checkpoint on the same
global batches (tests/distributed/pipeline_spec.py).

    pp2              1F1B, 2 stages cut on the block boundary (layers 0-1 | 2-3), 4 micro-batches
    pp2_interleaved  Interleaved1F1B, 4 stages of one layer (cuts inside blocks too)
    pp2_dp2          1F1B x FSDP2 over dp_shard = 2 (4 processes)
    pp2_ep2          1F1B x EP 2 on dp_shard = 2 (4 processes)
    *_chunked        pp2, pp2_interleaved, pp2_dp2 with training.loss_chunk = 32: the last
                     stage returns its normed hidden states and its loss is the chunked LM-head
                     cross-entropy, 2 chunks of a micro-batch's 64 tokens
    *_offload        pp2, pp2_chunked, pp2_interleaved with training.activation_offload (full
                     AC): the schedule step runs under save_on_cpu

Every layout's per-step loss equals one process's within rtol 2e-5: they differ only in fp32
summation order (micro-batch gradients summed one by one, FSDP's reduce-scatter, EP's regrouped
expert GEMMs), a few ulps per step; a wrong loss scale, stage or dispatch moves them by > 1e-3.
The chunked layouts are compared with the same tolerances against the full-logits one process:
both losses are fp32 sums of fp32 log-sum-exps minus target logits of the same products, and the
head weight's gradient the same products summed by chunk, so only the summation order differs
(observed at most 1.8e-7 relative in the loss and 2e-7 in the grad norm, as in the full-logits
layouts). Checked by hand on pp2_chunked: the chunked loss not divided by the token count logs
losses of 1341 for 5.24; the head weight's gradient dropped, step 2's loss is 7e-4 off and
every grad norm about half. Each chunked layout asserts its ranks holding the last stage logged
the chunked loss, so a run that fell back to the full logits fails too.
The offload layouts are compared with the same tolerances against one process: the offload moves
bytes (exact host copies), not values, and full AC recomputes the same values, so only the
pipeline's fp32 summation order differs from one process; against the same layout without the
offload (same stages, same order) their losses and grad norms are equal (observed bitwise on the
CPU host, 2026-12-05). Every rank of an offload layout logs how many tensors its first step's
save_on_cpu packed, and that count must be > 0: a run with the offload silently off fails.
max_norm 0.5 is below every step's grad norm (0.6 to 0.8), so every step clips, inside the fused
AdamW kernel (titan_moe/train/step_guard.py); the logged grad norm, reduced over the stages (and
the expert and dense meshes), matches one process's within rtol 1e-5 (observed 2e-7).
QB biases (each stage balances its own MoE layers, histograms summed over the data ranks only)
and moe/max_violation (gathered over the stages) match to 1e-6: the loads are exact counts.
torch's first-step shape inference must count none (RoutedPipelineStage): on torch 2.11, where
it once did, step 1's biases were 4e-3 to 3e-2 off (CPU host) and step 5's grad norm 1.1e-5
relative (GPU machine, CPU gloo), 2026-12-06; now its PP runs equal 2.13's bit for bit.
Resume: the pp2 run's step-3 checkpoint, loaded by a fresh pp2 job, reproduces steps 4-5 of the
uninterrupted run exactly (same processes, same order of operations).

The runs of each process count share one launch with the other test modules' registered runs
(tests/distributed/train_jobs.py: one job after the other, each as `python -m titan_moe.train`
runs it): a launch's start, torch, torchtitan and titan_moe imported on every rank, takes longer
than a job's few steps.

Multimodal: the same model with the debug vision tower on text + scikit-learn digits (the real
titan_moe dataloader; one data rank in both layouts, so the same batches), 3 steps from one seed
checkpoint, pp2 (the tower on the first stage) against one process: losses within LOSS_RTOL, and
the tower's weights after step 3 within 1% of how far each moved (TOWER_SHARE_OF_MOVE) of one
process's, while each moved by > 1e-3 from the seed, so the images went through the tower and its
gradients arrived.

Validation: the same model on the titan_moe spec's corpus (pystdlib; one data rank in every
layout, so the same batches), 3 steps from one seed checkpoint, validated at steps 1 and 2 on
2 batches of 4 x 64 tokens. pp2 (1F1B) and pp2_interleaved_chunked (Interleaved1F1B with
training.loss_chunk = 32) log the one-process validation loss within LOSS_RTOL (observed 1.1e-7
relative on pp2, equal on the interleaved chunked run, on the CPU host on 2026-12-06), on every
rank, once per validated step; a run without the validation lines fails. pp2 with validation
trains exactly as pp2 without it (losses, grad norms, moe/max_violation bitwise).
"""

import re
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.distributed.train_jobs import ROOT, register, shared_runs
from tests.train.conftest import read_scalars

STEPS = 5
LOSS_RTOL = 2e-5
MAX_NORM = 0.5
NORM_RTOL = 1e-5
BIAS_ATOL = 1e-6
MOE_LAYERS = (1, 2, 3)
TINY = [
    "--job.config_file", "configs/debug.toml",
    "--experimental.custom_import", "tests.distributed.pipeline_spec",
    "--model.name", "titan_moe_rows",
    "--titan_moe.vocab_size", "128", "--titan_moe.dim", "64", "--titan_moe.n_layers", "4",
    "--titan_moe.mla_layers", "4", "--titan_moe.dense_hidden", "128",
    "--titan_moe.attn_res_block_size", "2", "--titan_moe.n_heads", "2",
    "--titan_moe.head_dim", "32", "--titan_moe.kda_gate_rank", "16",
    "--titan_moe.mla_n_heads", "2", "--titan_moe.q_lora_rank", "32",
    "--titan_moe.kv_lora_rank", "16", "--titan_moe.qk_nope_head_dim", "16",
    "--titan_moe.qk_rope_head_dim", "16", "--titan_moe.v_head_dim", "16",
    "--titan_moe.n_experts", "8", "--titan_moe.top_k", "2", "--titan_moe.n_shared_experts", "1",
    "--titan_moe.shared_hidden", "32", "--titan_moe.latent_dim", "32",
    "--titan_moe.expert_hidden", "32",
    "--training.seq_len", "64", "--training.device", "cpu",
    "--lr_scheduler.warmup_steps", "2", "--lr_scheduler.decay_ratio", "0.0",
    "--metrics.log_freq", "1", "--metrics.disable_color_printing",
    "--training.max_norm", str(MAX_NORM),
]
PP2 = ["--parallelism.pipeline_parallel_degree", "2"]
LAYOUTS = {  # name: (processes, arguments); 4 global rows of 64 tokens in every layout
    "one_process": (1, ["--training.local_batch_size", "4"]),
    "pp2": (2, [*PP2, "--training.local_batch_size", "4"]),
    "pp2_interleaved": (2, [*PP2, "--training.local_batch_size", "4",
                            "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"]),
    "pp2_dp2": (4, [*PP2, "--training.local_batch_size", "2"]),
    "pp2_ep2": (4, [*PP2, "--training.local_batch_size", "2",
                    "--parallelism.expert_parallel_degree", "2"]),
}
CHUNKED = ["--training.loss_chunk", "32"]
LAYOUTS |= {f"{name}_chunked": (LAYOUTS[name][0], [*LAYOUTS[name][1], *CHUNKED])
            for name in ("pp2", "pp2_interleaved", "pp2_dp2")}
OFFLOAD = ["--training.activation_offload", "--activation_checkpoint.mode", "full"]
LAYOUTS |= {f"{name}_offload": (LAYOUTS[name][0], [*LAYOUTS[name][1], *OFFLOAD])
            for name in ("pp2", "pp2_chunked", "pp2_interleaved")}
OFFLOAD_LOG = re.compile(r"activation offload: the pipeline step packed (\d+) saved tensors")
# Bytes a micro-batch (1 row of 64 tokens, d 64, fp32) sends across a cut before layer i:
# ceil(i / 2) + 1 hidden states of 64 x 64 x 4 B = 16384 B (the doc_ids do not cross).
CUT_BYTES = {
    "pp2": {2: 2 * 16384},
    "pp2_interleaved": {1: 2 * 16384, 2: 2 * 16384, 3: 3 * 16384},
}


def scalars(dump: Path, tag: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for run_dir in sorted((dump / "tb").iterdir()):
        out.update(read_scalars(run_dir, tag))
    return out


def assert_losses_close(got: dict[int, float], want: dict[int, float], steps: list[int]) -> None:
    """got holds a loss at exactly `steps`, each within LOSS_RTOL of want's."""
    assert sorted(got) == steps
    torch.testing.assert_close(torch.tensor([got[s] for s in steps]),
                               torch.tensor([want[s] for s in steps]), rtol=LOSS_RTOL, atol=0)


def biases(dump: Path) -> list[dict[int, torch.Tensor]]:
    """Per step, every MoE layer's QB bias; the ranks holding a layer must agree exactly."""
    ranks = [torch.load(f) for f in sorted((dump / "qb_biases").glob("rank*.pt"))]
    merged: list[dict[int, torch.Tensor]] = []
    for step in zip(*ranks, strict=True):
        layers: dict[int, torch.Tensor] = {}
        for held in step:
            for layer, bias in held.items():
                if layer in layers:
                    assert torch.equal(layers[layer], bias), f"ranks disagree on layer {layer}"
                layers[layer] = bias
        merged.append(layers)
    return merged


@pytest.fixture(scope="module")
def runs(launched) -> dict[str, tuple[Path, str]]:
    return launched["rows"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "one_process"])
def test_losses_biases_and_violation_match_one_process(runs, name):
    reference, got = runs["one_process"][0], runs[name][0]
    want_loss = scalars(reference, "loss_metrics/global_avg_loss")
    loss = scalars(got, "loss_metrics/global_avg_loss")
    assert_losses_close(loss, want_loss, list(range(1, STEPS + 1)))
    assert want_loss[STEPS] != want_loss[1]
    want_norm, norm = scalars(reference, "grad_norm"), scalars(got, "grad_norm")
    assert sorted(norm) == sorted(want_norm) and min(want_norm.values()) > MAX_NORM
    for step in want_norm:
        assert norm[step] == pytest.approx(want_norm[step], rel=NORM_RTOL), step
    chunked_logs = runs[name][1].count("pipeline loss: the last stage's chunked LM-head")
    # Logged once by each rank holding the last stage (pp2_dp2: two).
    assert chunked_logs == (LAYOUTS[name][0] // 2 if "_chunked" in name else 0)
    packed = [int(n) for n in OFFLOAD_LOG.findall(runs[name][1])]
    # Logged once by every pipeline rank, each of which packed something.
    assert len(packed) == (LAYOUTS[name][0] if name.endswith("_offload") else 0), packed
    assert all(n > 0 for n in packed), packed
    want_biases, got_biases = biases(reference), biases(got)
    assert len(got_biases) == STEPS and sorted(got_biases[0]) == list(MOE_LAYERS)
    for step, (g, w) in enumerate(zip(got_biases, want_biases, strict=True), start=1):
        for layer in MOE_LAYERS:
            torch.testing.assert_close(g[layer], w[layer], rtol=0, atol=BIAS_ATOL,
                                       msg=f"step {step} layer {layer}")
    for tag in ["moe/max_violation"] + [f"moe/layer{i}/max_violation" for i in MOE_LAYERS]:
        want, value = scalars(reference, tag), scalars(got, tag)
        assert sorted(value) == sorted(want), tag
        for step in want:
            assert value[step] == pytest.approx(want[step], abs=1e-6), (tag, step)


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in LAYOUTS if n.endswith("_offload")])
def test_offload_trains_exactly_as_the_same_layout_without_it(runs, name):
    plain = runs[name.removesuffix("_offload")][0]
    for tag in ("loss_metrics/global_avg_loss", "grad_norm"):
        want, got = scalars(plain, tag), scalars(runs[name][0], tag)
        assert sorted(got) == list(range(1, STEPS + 1)) and got == want, tag


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CUT_BYTES))
def test_start_up_logs_the_bytes_each_cut_sends(runs, name):
    log = runs[name][1]
    for layer, size in CUT_BYTES[name].items():
        assert f"before layer {layer} " in log and f"): {size:,} bytes per micro-batch" in log, (
            layer, size)
    cuts = [line for line in log.splitlines() if "pipeline cut" in line]
    # Every rank logs the cuts once.
    assert len(cuts) == 2 * len(CUT_BYTES[name]), cuts


@pytest.mark.slow
def test_resume_under_pp2_reproduces_the_uninterrupted_run(runs):
    straight, (resumed, log) = runs["pp2"][0], runs["pp2_resumed"]
    loaded = [line for line in log.splitlines() if "Loading the checkpoint from" in line]
    assert loaded and all(line.rstrip(".").endswith("step-3") for line in loaded), loaded
    want, got = (scalars(d, "loss_metrics/global_avg_loss") for d in (straight, resumed))
    assert sorted(got) == [4, 5]
    assert [got[s] for s in (4, 5)] == [want[s] for s in (4, 5)]
    for g, w in zip(biases(resumed), biases(straight)[3:], strict=True):
        for layer in MOE_LAYERS:
            assert torch.equal(g[layer], w[layer]), layer


MM_STEPS = 3
MOVED = 1e-3
# pp2 against one process, per tower tensor: at most 1% of how far the tensor moved. The two
# runs sum their gradients in different orders (fp32, about 1e-7 relative), and AdamW divides
# each element's step by its own gradient scale, so an element whose gradient is near zero can
# land 1e-6 .. 1e-5 apart after three steps (6.7e-6 of a 5.2e-3 move, 0.13%, on the CPU host on
# 2026-12-05, where a fixed 1e-6 failed at code that had passed it before). A stage that
# trained the tower wrongly lands a step (about 1.7e-3) apart.
TOWER_SHARE_OF_MOVE = 1e-2


def tiny_corpus() -> list[str]:
    """TINY on the titan_moe spec's own dataloader (pystdlib text), whose tokenizer needs the
    full 4096-id vocabulary; unshuffled, and with one data rank the same batches in every
    layout."""
    args = list(TINY)
    args[args.index("titan_moe_rows")] = "titan_moe"
    args[args.index("--titan_moe.vocab_size") + 1] = "4096"
    return [*args, "--training.shuffle_windows", "0"]


def tiny_multimodal() -> list[str]:
    """tiny_corpus with text + digits and the debug vision tower."""
    return [*tiny_corpus(), "--titan_moe.vision", "debug", "--training.image_data", "digits"]


def tower(checkpoint: Path, out: Path) -> dict[str, torch.Tensor]:
    """The vision tower's weights in a DCP checkpoint."""
    dcp_to_torch_save(checkpoint, out)
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if k.startswith("vision.")}


@pytest.mark.slow
def test_multimodal_pp2_with_the_tower_on_the_first_stage_matches_one_process(launched, tmp_path):
    dumps = {name: dump for name, (dump, _) in launched["mm"].items()}
    assert "pipeline stages (layers): ['0-1', '2-3']" in launched["mm"]["pp2"][1]
    want, got = (scalars(dumps[d], "loss_metrics/global_avg_loss") for d in ("one_process", "pp2"))
    assert_losses_close(got, want, list(range(1, MM_STEPS + 1)))
    start = tower(dumps["seed"] / "checkpoint" / "step-0", tmp_path / "seed.pt")
    one = tower(dumps["one_process"] / "checkpoint" / f"step-{MM_STEPS}", tmp_path / "one.pt")
    pp2 = tower(dumps["pp2"] / "checkpoint" / f"step-{MM_STEPS}", tmp_path / "pp2.pt")
    assert start and start.keys() == one.keys() == pp2.keys()
    for name, weight in pp2.items():
        moved = (weight - start[name]).abs().max().item()
        assert moved > MOVED, f"{name} did not train"
        torch.testing.assert_close(weight, one[name], rtol=0,
                                   atol=TOWER_SHARE_OF_MOVE * moved, msg=name)


VAL_STEPS = 3
VALIDATED = (1, 2)  # torchtitan validates at step 1 and every validation.freq-th step
VALIDATION = ["--validation.enable", "--validation.dataset", "pystdlib",
              "--validation.freq", "2", "--validation.steps", "2",
              "--validation.local_batch_size", "4", "--validation.seq_len", "64"]
VALIDATION_LAYOUTS = {  # name: (processes, arguments), one data rank each
    "one_process": (1, VALIDATION),
    "pp2": (2, [*PP2, *VALIDATION]),
    "pp2_interleaved_chunked": (2, [*PP2, "--parallelism.pipeline_parallel_schedule",
                                    "Interleaved1F1B", *CHUNKED, *VALIDATION]),
    "pp2_unvalidated": (2, PP2),
}
VALIDATE_LOG = re.compile(r"validate step:\s+(\d+)\s+loss:\s+(-?[\d.]+)")


@pytest.fixture(scope="module")
def validation_runs(launched) -> dict[str, tuple[Path, str]]:
    return launched["validation"]


SEED = ["--training.local_batch_size", "4", "--checkpoint.enable",
        "--checkpoint.create_seed_checkpoint"]


FAMILIES = {  # name: base, arguments of every run but the seed, layouts
    "rows": (TINY, ["--training.steps", str(STEPS), "--checkpoint.enable",
                    "--checkpoint.interval", "3"], LAYOUTS),
    "validation": (tiny_corpus(), ["--training.steps", str(VAL_STEPS),
                                   "--training.local_batch_size", "4", "--checkpoint.enable"],
                   VALIDATION_LAYOUTS),
    "mm": (tiny_multimodal(), ["--training.steps", str(MM_STEPS), "--training.local_batch_size",
                               "4", "--checkpoint.enable"],
           {"one_process": (1, []), "pp2": (2, PP2)}),
}
# Every training run of this module, by family (rows: LAYOUTS and pp2_resumed; validation:
# VALIDATION_LAYOUTS; mm: the multimodal test's), each family's runs from its seed checkpoint.
# The test process launches them with the other modules' registered runs, one launch for each
# process count (tests/distributed/train_jobs.py).
for _family, (_base, _common, _layouts) in FAMILIES.items():
    register(f"pipeline/{_family}/seed", 1, [*_base, *SEED])
    _seed = ["--checkpoint.initial_load_path", f"{ROOT}/pipeline/{_family}/seed/checkpoint/step-0"]
    for _name, (_processes, _args) in _layouts.items():
        register(f"pipeline/{_family}/{_name}", _processes, [*_base, *_common, *_seed, *_args])
# A fresh pp2 job on the pp2 run's step-3 checkpoint (alone in its checkpoint folder: the latest,
# which the job loads), after that run in the same launch.
register("pipeline/rows/pp2_resumed", 2,
         [*TINY, *PP2, "--training.local_batch_size", "4", "--training.steps", str(STEPS),
          "--checkpoint.enable", "--checkpoint.interval", "3"],
         before=["shutil:copytree", f"{ROOT}/pipeline/rows/pp2/checkpoint/step-3",
                 f"{ROOT}/pipeline/rows/pp2_resumed/checkpoint/step-3"])


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, dict[str, tuple[Path, str]]]:
    """family: {layout: (dump folder, log)}."""
    out: dict[str, dict[str, tuple[Path, str]]] = {family: {} for family in FAMILIES}
    for key, run in shared_runs(tmp_path_factory).items():
        if key.startswith("pipeline/"):
            _, family, name = key.split("/")
            out[family][name] = run
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["one_process", "pp2", "pp2_interleaved_chunked"])
def test_validation_under_pp_matches_one_process(validation_runs, name):
    """The validation loss (2 batches of 4 x 64 tokens, at steps 1 and 2) equals one process's
    within LOSS_RTOL: the same forward products in another fp32 order (per micro-batch rows,
    the CE summed by micro-batch, with loss_chunk by head chunk), on weights that one training
    step apart differ by the training layouts' few ulps. Every rank logs it (the ranks without
    the last stage take the pipeline's sum), once per validated step, with the value
    TensorBoard holds from the metrics rank; training's losses stay one process's."""
    processes = VALIDATION_LAYOUTS[name][0]
    reference, (dump, log) = validation_runs["one_process"][0], validation_runs[name]
    want = scalars(reference, "validation_metrics/loss")
    got = scalars(dump, "validation_metrics/loss")
    assert_losses_close(got, want, list(VALIDATED))
    assert want[VALIDATED[0]] != want[VALIDATED[1]]  # the next batches, on a trained model
    logged = VALIDATE_LOG.findall(log)
    assert sorted(int(step) for step, _ in logged) == sorted(VALIDATED * processes), logged
    for step, loss in logged:  # printed with 4 decimals
        assert float(loss) == pytest.approx(got[int(step)], abs=5e-5), (step, loss)
    want_train = scalars(reference, "loss_metrics/global_avg_loss")
    train_loss = scalars(dump, "loss_metrics/global_avg_loss")
    assert_losses_close(train_loss, want_train, list(range(1, VAL_STEPS + 1)))
    chunked_logs = log.count("pipeline loss: the last stage's chunked LM-head")
    assert chunked_logs == (1 if "_chunked" in name else 0)


@pytest.mark.slow
def test_validation_under_pp_leaves_training_unchanged(validation_runs):
    """pp2 trains exactly as pp2 without validation: validation advances neither the training
    data nor the RNG, counts no QB statistics and leaves no module in eval mode."""
    validated = validation_runs["pp2"][0]
    plain, plain_log = validation_runs["pp2_unvalidated"]
    assert not VALIDATE_LOG.findall(plain_log)
    for tag in ("loss_metrics/global_avg_loss", "grad_norm", "moe/max_violation"):
        want, got = scalars(plain, tag), scalars(validated, tag)
        assert sorted(got) == list(range(1, VAL_STEPS + 1)) and got == want, tag
