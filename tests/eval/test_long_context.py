"""Long-context evaluation: bucket losses against a per-position loop, the needle layout, and
the trainer writing both to TensorBoard at the last step."""

from pathlib import Path

import torch
import torch.nn.functional as F
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.faults.trainer_process import train_process
from titan_moe.eval.long_context import (
    NeedleSpec,
    _needle_context,
    loss_by_position,
    needle_probe,
    token_losses,
)
from titan_moe.model.args import get_flavor
from titan_moe.model.model import TitanMoE

REPO = Path(__file__).resolve().parents[2]
TOL = 1e-5  # float32 means of the same per-token losses, summed in another order


def _tiny_model() -> TitanMoE:
    torch.manual_seed(0)
    args = get_flavor("debug")
    args.n_layers, args.mla_layers = 2, (2,)
    model = TitanMoE(args.validate())
    model.init_weights()
    return model.eval()


def test_bucket_loss_equals_a_direct_per_position_computation():
    model = _tiny_model()
    torch.manual_seed(1)
    tokens = torch.randint(0, model.args.vocab_size, (2, 129))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    doc_ids = torch.zeros(2, 128, dtype=torch.int32)
    doc_ids[0, 40:] = 1
    doc_ids[1, 90:] = 1
    buckets = (0, 16, 64, 1024)
    metrics = loss_by_position(token_losses(model, inputs, labels, doc_ids), doc_ids, buckets)

    with torch.no_grad():
        logits = model(inputs, doc_ids)
    sums, counts = {}, {}
    for b in range(2):
        start = 0
        for t in range(128):
            if t > 0 and doc_ids[b, t] != doc_ids[b, t - 1]:
                start = t
            bucket = next(i for i in range(3) if buckets[i] <= t - start < buckets[i + 1])
            loss = F.cross_entropy(logits[b, t], labels[b, t]).item()
            sums[bucket] = sums.get(bucket, 0.0) + loss
            counts[bucket] = counts.get(bucket, 0) + 1
    expected = {f"long_context/loss_pos_{lo}_{name}": sums[i] / counts[i]
                for i, (lo, name) in enumerate([(0, "16"), (16, "64"), (64, "1K")])}
    assert metrics.keys() == expected.keys()
    for key, value in expected.items():
        assert abs(metrics[key] - value) < TOL * value, (key, metrics[key], value)


def test_needle_sits_at_its_depth_and_ends_the_context():
    spec = NeedleSpec(lengths=(100,), depths=(0.5,), key_tokens=3, value_tokens=2)
    haystack = torch.arange(1000, 1200)
    tokens, value_at = _needle_context(haystack, 100, 0.5, spec, 50, torch.Generator())
    needle = tokens[-5:]
    text = 100 - 10
    assert tokens.numel() == 100 and value_at == 98
    assert torch.equal(tokens[45:50], needle) and bool((needle < 50).all())
    assert torch.equal(torch.cat([tokens[:45], tokens[50:95]]), haystack[:text])


def test_needle_probe_scores_every_length_and_depth():
    model = _tiny_model()
    spec = NeedleSpec(lengths=(64, 128), depths=(0.0, 1.0), trials=1)
    haystack = torch.randint(0, model.args.vocab_size, (128,))
    metrics = needle_probe(model, haystack, spec, model.args.vocab_size)
    assert len(metrics) == 8
    for key, value in metrics.items():
        assert (value <= 0) if "logprob" in key else (0 <= value <= 1), (key, value)


def test_trainer_logs_the_long_context_eval_to_tensorboard(tmp_path):
    args = [
        "--job.config_file", "configs/debug.toml", "--job.dump_folder", str(tmp_path),
        "--titan_moe.n_layers", "2", "--titan_moe.mla_layers", "2",
        "--training.seq_len", "256", "--training.local_batch_size", "1", "--training.steps", "2",
        "--training.shuffle_windows", "0", "--lr_scheduler.warmup_steps", "1",
        "--metrics.log_freq", "1", "--checkpoint.no_enable", "--training.device", "cpu",
        "--eval.long_context", "--eval.needle_lengths", "128", "256",
        "--eval.needle_depths", "0.5", "--eval.needle_trials", "1",
    ]
    # `python -m titan_moe.train`'s main in a process forked from trainer_process.py's server
    # (the trainer imported once for the test session).
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "PYTHONPATH": str(REPO)}
    result = train_process(args, env, REPO, tmp_path / "train.log")
    assert result.returncode == 0, result.log[-4000:]
    (run_dir,) = (tmp_path / "tb").iterdir()
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"long_context/loss_pos_0_1K", "long_context/needle_acc/len128_depth0.5",
                "long_context/needle_logprob/len256_depth0.5"}
    assert expected <= tags, sorted(tags)
    assert [s.step for s in events.Scalars("long_context/loss_pos_0_1K")] == [2]
