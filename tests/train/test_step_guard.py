"""Finite-or-stop training: a non-finite step is skipped and counted, N in a row stop the run,
and no checkpoint is written from non-finite weights; on the fused optimizer the clip runs inside
the AdamW kernel and the step makes no host read.

References: a skipped step leaves no trace, so (NaN step, step on x) must equal (step on x)
exactly: the same weights, Adam state and Quantile Balancing bias. The fused path's clip is
checked against torch's `clip_grad_norm_` followed by the for-loop AdamW (no grad_scale, no
found_inf): the kernels differ only in fp32 rounding (divide by the inverted coefficient vs
multiply by it; fused vs for-loop Adam arithmetic), so 3 steps at lr 0.1 agree within
atol 1e-6, rtol 1e-5 (observed max difference 6e-8); the clip left out moves them by 0.15.
"""

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.distributed import utils as tt_dist_utils

from tests.faults.trainer_process import train_process
from titan_moe.model.quantile_balance import QuantileBalancer
from titan_moe.model.router import Router
from titan_moe.train.optimizer import attach_load_balancing
from titan_moe.train.step_guard import FiniteStepGuard, NonFiniteError, check_finite_weights

REPO = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = ["fused", "for-loop"]


class RoutedLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.router = Router(dim=8, n_experts=4, top_k=2)
        self.router.init_weights(0.5)
        self.proj = nn.Linear(8, 1)
        # A buffer, so that .to(device) moves it: a copy from the host inside forward would
        # synchronise the sync-free CUDA step.
        self.register_buffer("slot_weights", torch.tensor([1.0, -3.0]), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Slots weighted unequally: Σ weights alone is the route scale in every row, whose
        # gradient w.r.t. the router's logits is exactly 0, and the router would not train.
        _, weights = self.router(x)
        return (weights * self.slot_weights).sum() + self.proj(x).sum()


def _guarded(monkeypatch, max_consecutive: int = 3, implementation: str = "for-loop",
             device: str = "cpu") -> tuple[RoutedLinear, FiniteStepGuard]:
    # The guard stands in for torchtitan's clip_grad_norm_; monkeypatch puts it back after.
    monkeypatch.setattr(tt_dist_utils, "clip_grad_norm_", tt_dist_utils.clip_grad_norm_)
    model = RoutedLinear().to(device)
    fused = implementation == "fused"
    optimizers = OptimizersContainer([model], torch.optim.AdamW,
                                     {"lr": 0.1, "fused": fused, "foreach": False})
    attach_load_balancing(optimizers, [QuantileBalancer(model)])
    guard = FiniteStepGuard(optimizers, max_consecutive)
    assert guard.fused == fused
    return model, guard


def _step(model: RoutedLinear, guard: FiniteStepGuard, step: int, x: torch.Tensor,
          nan: bool = False, inf_grad: bool = False, max_norm: float = 1.0) -> None:
    """One training step in torchtitan's order: zero grads, loss, backward, clip, optimizer step.
    `nan`: the loss (and so every gradient) is NaN; `inf_grad`: one gradient holds an inf while
    the loss is finite."""
    guard.optimizers.zero_grad()
    guard.begin(step)
    loss = model(x) * (math.nan if nan else 1.0)
    loss.backward()
    if inf_grad:
        model.proj.weight.grad[0, 0] = math.inf
    guard.add_loss(loss)
    tt_dist_utils.clip_grad_norm_(list(model.parameters()), max_norm)
    guard.optimizers.step()


def _trace(model: RoutedLinear, guard: FiniteStepGuard) -> dict[str, torch.Tensor]:
    """Everything a step may change: weights, Adam state, the QB bias."""
    (optimizer,) = guard.optimizers
    trace = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, p in model.named_parameters():
        for key, value in optimizer.state.get(p, {}).items():
            trace[f"{name}.{key}"] = value.clone()
    trace["expert_bias"] = model.router.expert_bias.clone()
    return trace


def _assert_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_a_nan_step_is_skipped_without_trace(monkeypatch, implementation):
    x1, x2 = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(1))
    skipping, guard = _guarded(monkeypatch, implementation=implementation)
    _step(skipping, guard, 1, x1, nan=True)
    # The fused path learns of the skip one step late, or when asked (stats: at a log step).
    assert guard.skipped == (0 if guard.fused else 1)
    assert guard.stats() == {"train/skipped_steps": 1}
    if not guard.fused:  # the fused step leaves the gradients to the next step's zero_grad
        assert all(p.grad is None or not p.grad.any() for p in skipping.parameters())
    assert not skipping.router.qb_hist.any() and not skipping.router.expert_bias.any()
    _step(skipping, guard, 2, x2)
    reference, reference_guard = _guarded(monkeypatch, implementation=implementation)
    _step(reference, reference_guard, 1, x2)
    assert guard.stats() == {"train/skipped_steps": 1} and guard.consecutive == 0
    assert skipping.router.expert_bias.any()  # the finite step did apply Quantile Balancing
    _assert_equal(_trace(skipping, guard), _trace(reference, reference_guard))


@pytest.mark.parametrize("fault", ["nan_loss", "inf_grad"])
def test_a_fused_non_finite_step_changes_nothing_and_is_counted(monkeypatch, fault):
    x1, x2 = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(2))
    model, guard = _guarded(monkeypatch, implementation="fused")
    _step(model, guard, 1, x1)
    before = _trace(model, guard)
    assert before["proj.weight.step"] == 1 and before["expert_bias"].any()
    _step(model, guard, 2, x2, nan=fault == "nan_loss", inf_grad=fault == "inf_grad")
    assert not model.router.qb_hist.any()  # the skipped step's statistics are dropped
    _assert_equal(_trace(model, guard), before)
    assert guard.stats() == {"train/skipped_steps": 1} and guard.consecutive == 1


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_consecutive_nan_steps_stop_naming_the_step(monkeypatch, implementation):
    model, guard = _guarded(monkeypatch, max_consecutive=2, implementation=implementation)
    x = torch.randn(32, 8)
    _step(model, guard, 5, x, nan=True)
    stop = pytest.raises(NonFiniteError, match=r"^step 6: 2 steps in a row with a non-finite loss")
    if guard.fused:  # one step late: step 7's optimizer step counts step 6
        _step(model, guard, 6, x, nan=True)
        assert guard.skipped == 1
        with stop:
            _step(model, guard, 7, x)
    else:
        with stop:
            _step(model, guard, 6, x, nan=True)


def test_fused_consecutive_nan_steps_stop_at_the_next_log_or_save(monkeypatch):
    model, guard = _guarded(monkeypatch, max_consecutive=2, implementation="fused")
    x = torch.randn(32, 8)
    _step(model, guard, 5, x, nan=True)
    _step(model, guard, 6, x, nan=True)
    with pytest.raises(NonFiniteError, match=r"^step 6: 2 steps in a row"):
        guard.settle()


def fused_clip_against_reference(monkeypatch, max_norm: float, device: str) -> None:
    """3 fused steps against torch's clip_grad_norm_ then the for-loop AdamW, on `device`."""
    # Norms of about 38, 286 and 32: clipped to 0.5 they differ from the raw ones in ratio, which
    # Adam's update sees (a constant factor it would mostly normalise away).
    xs = torch.randn(3, 32, 8, generator=torch.Generator().manual_seed(3)).to(device)
    xs = xs * torch.tensor([1.0, 20.0, 0.05], device=device).view(3, 1, 1)
    model, guard = _guarded(monkeypatch, implementation="fused", device=device)
    reference = RoutedLinear().to(device)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, foreach=False)
    balancer = QuantileBalancer(reference)
    for step, x in enumerate(xs, 1):
        _step(model, guard, step, x, max_norm=max_norm)
        optimizer.zero_grad()
        reference(x).backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm)
        optimizer.step()
        balancer.step()
        # The guard keeps the norm before clipping, which the trainer logs.
        torch.testing.assert_close(guard.grad_norm, norm, rtol=1e-6, atol=0)
        assert (norm > max_norm) == (max_norm < 1)  # each case is what its name says
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    torch.testing.assert_close(model.router.expert_bias, reference.router.expert_bias,
                               rtol=1e-5, atol=1e-6)
    assert guard.stats() == {"train/skipped_steps": 0}


@pytest.mark.parametrize("max_norm", [0.5, 1e3], ids=["clipped", "unclipped"])
def test_fused_clip_matches_torch_clip_then_adamw(monkeypatch, max_norm):
    fused_clip_against_reference(monkeypatch, max_norm, "cpu")


def test_a_fused_step_reads_nothing_back_before_its_update_is_queued(monkeypatch):
    """Every host read (item, bool, float, int, tolist) is logged with the optimizer updates: the
    first step reads nothing, the second one value list (the first step's outcome), after its
    own update is queued."""
    model, guard = _guarded(monkeypatch, implementation="fused")
    events: list[str] = []
    for read in ("item", "__bool__", "__float__", "__int__", "tolist"):
        original = getattr(torch.Tensor, read)

        def logged(self, *args, _original=original, _read=read):
            events.append(_read)
            return _original(self, *args)

        monkeypatch.setattr(torch.Tensor, read, logged)
    (optimizer,) = guard.optimizers
    update = optimizer.step
    monkeypatch.setattr(optimizer, "step", lambda *a, **k: (events.append("update"), update())[1])
    x1, x2 = torch.randn(2, 32, 8, generator=torch.Generator().manual_seed(4))
    _step(model, guard, 1, x1)
    assert events == ["update"]
    _step(model, guard, 2, x2)
    assert events == ["update", "update", "tolist"]


def test_non_finite_weights_are_named_and_refused():
    model = RoutedLinear()
    check_finite_weights([model], 7)
    with torch.no_grad():
        model.proj.weight[0, 3] = math.inf
    with pytest.raises(NonFiniteError, match=r"checkpoint of step 7: proj\.weight \(and 0 more"):
        check_finite_weights([model], 7)


# --- The trainer: tiny debug model, CPU, one process ---------------------------------------------


def _train(dump: Path, data: Path, *args: str, nan_steps: str = "", nan_ranks: str = "",
           n_proc: int = 1) -> tuple[int, str]:
    """(exit status, stdout + stderr) of a 4-step run of the tiny debug model: one process forked
    from tests/faults/trainer_process.py's server (the trainer imported once, not per run) or
    `n_proc` under torchrun."""
    tiny = [
        "--job.config_file", "configs/debug.toml", "--job.dump_folder", str(dump),
        "--titan_moe.n_layers", "3", "--titan_moe.mla_layers", "3",
        "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.shuffle_windows", "0", "--training.dataset_path", str(data),
        "--training.steps", "4", "--metrics.log_freq", "1", "--metrics.disable_color_printing",
        "--training.device", "cpu", "--experimental.custom_import", "tests.train.nan_loss",
    ]
    env = {"OMP_NUM_THREADS": str(2 // n_proc), "PATH": "/usr/bin:/bin", "HOME": str(dump),
           "PYTHONPATH": str(REPO), "NAN_STEPS": nan_steps, "NAN_RANKS": nan_ranks}
    if n_proc == 1:
        dump.mkdir(parents=True, exist_ok=True)
        run = train_process([*tiny, *args], env, REPO, dump / "train.log")
        return run.returncode, run.log
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={n_proc}", "-m", "titan_moe.train"]
    run = subprocess.run([*launcher, *tiny, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300, env=env)
    return run.returncode, run.stdout + run.stderr


@pytest.fixture
def corpus(tmp_path):
    """60 documents of 40 words; line 3 is not JSON."""
    line = json.dumps({"text": " ".join(["def f(x): return x"] * 8)}) + "\n"
    path = tmp_path / "corpus.jsonl"
    path.write_text(line * 2 + '{"text": "unterminated\n' + line * 58)
    return path


def test_trainer_skips_a_nan_step_and_a_bad_document_and_counts_both(tmp_path, corpus,
                                                                    scalars_of):
    status, log = _train(tmp_path, corpus, "--training.skip_bad_documents",
                         "--checkpoint.interval", "2", nan_steps="2")
    assert status == 0, log[-4000:]
    assert "step 2: non-finite loss or grad norm (loss nan" in log
    assert f"skipping bad document {corpus}:3: invalid JSON" in log
    (tb,) = (tmp_path / "tb").iterdir()
    assert scalars_of(tb, "train/skipped_steps") == [(1, 0), (2, 1), (3, 1), (4, 1)]
    assert scalars_of(tb, "data/skipped_documents")[-1] == (4, 1)
    losses = dict(scalars_of(tb, "loss_metrics/global_avg_loss"))
    assert math.isnan(losses[2]) and all(math.isfinite(losses[s]) for s in (1, 3, 4))
    checkpoints = sorted(p.name for p in (tmp_path / "checkpoint").iterdir())
    assert checkpoints == ["step-2", "step-4"]


def test_data_parallel_ranks_skip_together(tmp_path, corpus):
    # Only rank 1's loss is NaN; rank 0 sees a finite loss and must skip the step with it.
    status, log = _train(tmp_path, corpus, "--training.skip_bad_documents",
                         "--checkpoint.no_enable", nan_steps="2", nan_ranks="1", n_proc=2)
    assert status == 0, log[-4000:]
    losses = re.findall(r"step 2: non-finite loss or grad norm \(loss (\S+) on this rank", log)
    assert sorted(math.isnan(float(loss)) for loss in losses) == [False, True], log[-4000:]


def test_trainer_stops_after_n_non_finite_steps_naming_the_step(tmp_path, corpus):
    # lr 1e300 is inf in fp32: step 1's update makes the weights non-finite, every later loss NaN.
    status, log = _train(tmp_path, corpus, "--training.skip_bad_documents",
                         "--optimizer.lr", "1e300", "--training.max_consecutive_skipped_steps", "2",
                         "--checkpoint.no_enable")
    assert status != 0
    assert "NonFiniteError: step 3: 2 steps in a row with a non-finite loss" in log, log[-4000:]


def test_trainer_refuses_a_checkpoint_of_non_finite_weights(tmp_path, corpus):
    status, log = _train(tmp_path, corpus, "--training.skip_bad_documents",
                         "--optimizer.lr", "1e300", "--checkpoint.interval", "1")
    assert status != 0
    assert "NonFiniteError: refusing to save the checkpoint of step 1: " in log, log[-4000:]
    assert not (tmp_path / "checkpoint").exists()
