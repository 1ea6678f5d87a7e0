"""The long-context evaluation under context parallelism: 2 gloo ranks, each running its slab
of every sequence, give the metrics of 1 rank running whole sequences.

The model is test_context_parallel's (4 layers, KDA and MLA, float32); the reference is the
same weights unpatched on the whole rows, in each process. Documents cross the slab edge and
one starts at it, so a bucket counted on slab-local positions would differ. The needle lengths
cover a context that pads to whole chunks per rank (100 -> 128), one whose value tokens straddle
the slab edge (132 -> 256: positions 127 on rank 0, 128..130 on rank 1) and one that fills the
rows (256).

Tolerance: the runs differ in fp32 summation order only (the KDA state scan across slabs, the
gathered MLA prefix); the logits then agree to ~3e-7 of their largest magnitude
(test_context_parallel), so bucket losses (~5 nats) and needle log-probs agree to 1e-4 absolute
(measured 1e-6);
a wrong position, slab or padding moves them by more than 1e-2. Needle accuracy (an untrained
model scores 0 everywhere) must be equal.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.context_parallel.test_context_parallel import WORLD, _batch, _model
from tests.distributed.harness import end_rank
from titan_moe.eval.long_context import NeedleSpec, long_context_metrics
from titan_moe.parallel.context_parallel import apply_context_parallel

ATOL = 1e-4
BUCKETS = (0, 16, 64, 1024)
SPEC = NeedleSpec(lengths=(100, 132, 256), depths=(0.0, 0.5), trials=1)


def _metrics(model, group=None) -> dict[str, float]:
    tokens, labels, doc_ids = _batch(model.args.vocab_size)
    return long_context_metrics(model, tokens, labels, doc_ids, SPEC, model.args.vocab_size,
                                BUCKETS, group=group)


def _worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD)
    try:
        reference = _metrics(_model())
        model = _model()
        apply_context_parallel(model, dist.group.WORLD)
        results = {"reference": reference, "cp": _metrics(model, dist.group.WORLD)}
        torch.save(results, f"{out}.{rank}")
    except BaseException:
        dist.destroy_process_group()
        raise
    end_rank()


def test_two_ranks_give_the_long_context_metrics_of_one(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = str(tmp_path / "metrics")
    mp.spawn(_worker, args=(port, out), nprocs=WORLD)
    ranks = [torch.load(f"{out}.{rank}") for rank in range(WORLD)]
    reference = ranks[0]["reference"]
    assert {k.split("/")[1] for k in reference} == {
        "loss_pos_0_16", "loss_pos_16_64", "loss_pos_64_1K", "needle_logprob", "needle_acc"}
    assert len(reference) == 3 + 2 * len(SPEC.lengths) * len(SPEC.depths)
    for rank, result in enumerate(ranks):
        assert result["cp"].keys() == reference.keys()
        for key, want in reference.items():
            got = result["cp"][key]
            if "needle_acc" in key:
                assert got == want, (rank, key, got, want)
            else:
                assert abs(got - want) < ATOL, (rank, key, got, want)
