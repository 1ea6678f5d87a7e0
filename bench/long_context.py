"""Long-context training step: one forward+backward of a whole model at batch 1, per length.

    python bench/long_context.py --out lc.json                  # H200: proxy, 8K 64K 256K 1M
    python bench/long_context.py --tiny --out lc_cpu.json       # CPU smoke: debug, 2 layers

What makes long contexts fit: full activation checkpointing of every decoder layer (torchtitan's
apply_ac; --ac none to compare), with --offload the checkpoints' saved layer inputs in pinned host
memory (torch.autograd.graph.save_on_cpu around the step, as training.activation_offload does),
KDA by chunks with a constant state (the Triton op), MLA through Flash Attention's
varlen kernel with document masking (no [T, T] mask), and the trainer's chunked loss
(`training.loss_chunk`: the model runs under `hidden_from_head` and `ChunkedCrossEntropy` applies
the head by chunks of --loss-chunk positions, so the [T, vocab] logits never exist), and with
--moe-chunk the MoE layers by token chunks under their own checkpoints (titan_moe.moe_token_chunk:
one chunk's expert buffers alive in backward), and with --seq-segment the KDA mixers by segments
of positions (the recurrent state and conv taps carried between them), the MLA mixers by query
segments (each against its causal prefix's keys) and the dense FFN by token chunks, each under
its own checkpoint (titan_moe.seq_segment: a layer's recompute holds one segment's projections,
conv outputs and gates instead of all T positions'), and with --attn-res-sink the finished
blocks' gradients summed in place by the AttnRes sites' eager backward (titan_moe.
attn_res_grad_sink: a site returns one source gradient, not one a source), and with
--norm-saves-output the layers' input norms saving their outputs (titan_moe.norm_saves_output:
the sites' outputs are then saved by nothing, two [T, d] tensors fewer a layer). Parameters are
bf16 (FSDP's param_dtype in training; no fp32 master copy or optimizer state is held here).
Documents of --doc-len tokens keep attention's cost T·doc_len rather than T².
Per length: time of the step (median of --iters after --warmup), time per token, and
torch.cuda.max_memory_allocated (also per 1K tokens); a length that runs out of memory is a row
with status "oom" (its peak is the allocator's at the failure) and the next length still runs.
Every row carries the memory plan's peak for the same step (`titan_moe.plan.memory.bench_estimate`)
and, measured on CUDA, planned / measured (the plan's target: within 0.85 .. 1.15). With
--phase-peaks one step per length records the allocated memory by phase (the forward,
the loss's backward, each layer's backward with its recompute), to lay the peak at one phase
and set each layer's rise against the plan's recompute of it: the first warmup step (its
compile included), or without warmup one more step after the timed ones. An "oom" row carries
the allocator's message and, with --phase-peaks, the phases up to the one that ran out.
The CUDA allocator runs with expandable segments (PYTORCH_CUDA_ALLOC_CONF, unless set), as
torchtitan's launcher sets it: a long step's GiB-sized blocks then do not fail on fragmentation.
"""

import argparse
import contextlib
import gc
import json
import os
import time

import torch
from report import environment
from torchtitan.config import ActivationCheckpoint
from torchtitan.distributed.activation_checkpoint import apply_ac

from titan_moe.cli_args import non_negative, positive
from titan_moe.model.args import ConfigError, TitanMoEArgs, get_flavor
from titan_moe.model.model import TitanMoE
from titan_moe.parallel.parallelize import apply_compile
from titan_moe.plan.config import PlanConfig
from titan_moe.plan.memory import GIB, bench_estimate
from titan_moe.plan.saved import layer_activation_bytes
from titan_moe.train.chunked_loss import CHUNK, ChunkedCrossEntropy, hidden_from_head

LENGTHS = "8192,65536,262144,1048576"
TINY_LENGTHS = "128,256"


def model_args(flavor: str, n_layers: int | None, moe_chunk: int = 0,
               seq_segment: int = 0, attn_res_sink: bool = False,
               norm_saves_output: bool = False) -> TitanMoEArgs:
    args = get_flavor(flavor)
    if n_layers is not None:
        args.n_layers, args.mla_layers = n_layers, (n_layers,)
    args.moe_token_chunk, args.seq_segment = moe_chunk, seq_segment
    args.attn_res_grad_sink = attn_res_sink
    args.norm_saves_output = norm_saves_output
    return args.validate()


def build(args: TitanMoEArgs, device: str, dtype: torch.dtype, ac: str,
          compile_model: bool = False) -> TitanMoE:
    with torch.device("meta"):
        model = TitanMoE(args)
    model.to_empty(device=device)
    torch.manual_seed(0)  # the same weights every run: a row's loss repeats run to run
    model.init_weights()
    model.to(dtype)
    for module in model.modules():  # buffers (the QB biases) stay fp32, as under FSDP
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point():
                setattr(module, name, buf.float())
    if ac == "full":
        apply_ac(model, ActivationCheckpoint(mode="full"))
    if compile_model:  # per sublayer, as the trainer compiles (what the memory plan assumes)
        apply_compile(model, "inductor", set())
    return model


def planned_peak_gib(args: TitanMoEArgs, length: int, ac: str, loss_chunk: int,
                     offload: bool) -> float:
    """The memory plan's peak for this step: batch 1, bf16 weights and gradients."""
    cfg = PlanConfig(args, length, 1, ac, "1", loss_chunk, offload)
    return bench_estimate(cfg).peak / GIB


class Memory:
    """A length's allocated memory in GiB, from its first step on: CUDA's caching-allocator
    counters (`cuda`), none elsewhere (0). --phase-peaks resets the peak counter at every
    phase, so the counter alone ends with the last phase's peak; `step_peak` is the largest
    over every reset, the steps' peak."""

    def __init__(self, cuda: bool):
        self.cuda, self.earlier = cuda, 0.0
        if cuda:  # the previous length's peak is not this one's
            torch.cuda.reset_peak_memory_stats()

    def allocated(self) -> float:
        return torch.cuda.memory_allocated() / GIB if self.cuda else 0.0

    def counter_peak(self) -> float:
        """The peak since the counter's last reset."""
        return torch.cuda.max_memory_allocated() / GIB if self.cuda else 0.0

    def reset_counter(self) -> None:
        self.earlier = max(self.earlier, self.counter_peak())
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def step_peak(self) -> float:
        return max(self.earlier, self.counter_peak())


class PhasePeaks:
    """Allocated memory by phase of one step: the forward (with the loss), the loss's backward,
    then each decoder layer's backward from the gradient of its output on (its recompute under
    AC included). `rows` holds, per phase, the GiB allocated at its start and its peak (CUDA;
    0 elsewhere), so the step's peak can be laid at one phase and set against the plan."""

    def __init__(self, model: TitanMoE, memory: Memory):
        self.memory, self.rows, self.recording = memory, [], False
        self.handles = [layer.register_forward_hook(self._on_output(int(i)))
                        for i, layer in model.layers.items()]

    def _on_output(self, layer_id: int):
        def hook(module, args, output):
            # The recompute's outputs join no graph the backward runs: their hooks never fire.
            partial = output[1]
            if self.recording and partial.requires_grad:
                partial.register_hook(lambda grad: self.mark(f"backward, layer {layer_id}"))
        return hook

    def mark(self, phase: str) -> None:
        if self.rows:
            self.rows[-1]["peak_gib"] = self.memory.counter_peak()
        self.memory.reset_counter()
        start = self.memory.allocated()
        self.rows.append({"phase": phase, "start_gib": start, "peak_gib": start})

    def finish(self) -> list[dict]:
        self.mark("end")
        for handle in self.handles:
            handle.remove()
        return self.rows[:-1]


def step(model: TitanMoE, loss_fn: ChunkedCrossEntropy, tokens: torch.Tensor,
         labels: torch.Tensor, doc_ids: torch.Tensor, offload: bool = False,
         phases: PhasePeaks | None = None) -> float:
    # The checkpoints' hooks sit inside save_on_cpu's: only the layer inputs (and what is saved
    # outside the layers) go to the host; the recompute in backward stays on the GPU.
    saved = (torch.autograd.graph.save_on_cpu(pin_memory=tokens.is_cuda) if offload
             else contextlib.nullcontext())
    if phases is not None:
        phases.recording = True
        phases.mark("forward and loss")
    with saved, hidden_from_head(model.output):
        loss = loss_fn(model(tokens, doc_ids), labels)
    if phases is not None:
        phases.recording = False
        phases.mark("backward, loss")
    loss.backward()
    value = loss.item() / tokens.numel()
    model.zero_grad(set_to_none=True)
    return value


def _is_oom(error: BaseException) -> bool:
    # Kernels that allocate outside the caching allocator raise a plain RuntimeError.
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error)


def measure(model: TitanMoE, loss_fn: ChunkedCrossEntropy, length: int, doc_len: int,
            device: str, warmup: int, iters: int, offload: bool = False,
            phase_peaks: bool = False) -> dict:
    vocab = model.output.weight.shape[0]
    row = {"seq_len": length, "doc_len": min(doc_len, length)}
    if device == "cuda":
        torch.cuda.empty_cache()
    memory = Memory(device == "cuda")
    phases = None  # the step that records its phases, while it runs
    failed = False

    def run_step(record: bool) -> float:
        nonlocal phases
        phases = PhasePeaks(model, memory) if record else None
        value = step(model, loss_fn, tokens[:, :-1], tokens[:, 1:], doc_ids, offload, phases)
        if phases is not None:
            row["phases"], phases = phases.finish(), None
        return value

    try:
        # Seeded per length, as the weights are: the loss of a row repeats run to run.
        gen = torch.Generator(device=device).manual_seed(length)
        tokens = torch.randint(0, vocab, (1, length + 1), device=device, generator=gen)
        doc_ids = (torch.arange(length, device=device) // doc_len).to(torch.int32)[None]
        for i in range(warmup):  # each warmup step's time printed: a 1M step takes minutes
            start = time.perf_counter()
            # --phase-peaks: the first step records its phases, so that a length that runs out
            # of memory says in which phase (the hooks' host time stays out of the timed steps)
            run_step(phase_peaks and i == 0)
            print(f"{length:>9} warmup step {i + 1}: {time.perf_counter() - start:.1f} s, peak "
                  f"{memory.step_peak():.2f} GiB", flush=True)
        times = []
        for _ in range(iters):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            row["loss_per_token"] = run_step(False)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        if phase_peaks and not warmup:  # one more step, untimed
            run_step(True)
    except (torch.OutOfMemoryError, RuntimeError) as error:
        if not _is_oom(error):
            raise
        row["error"] = str(error).strip().splitlines()[0]  # "Tried to allocate ..." and the free
        if phases is not None:  # the last phase is the one that ran out
            row["phases"], phases = phases.finish(), None
        failed = True  # handled below, once the traceback no longer pins the step's tensors
    if failed:
        row["status"] = "oom"
        tokens = doc_ids = None  # drop this length's inputs before the next one
        model.zero_grad(set_to_none=True)
        gc.collect()
    else:
        seconds = sorted(times)[len(times) // 2]
        row.update(status="ok", step_s=seconds, us_per_token=1e6 * seconds / length)
    if memory.cuda:  # the timed steps' and, with --phase-peaks, every phase's
        peak = memory.step_peak()
        row.update(max_memory_allocated_gib=peak, gib_per_1k_tokens=1024 * peak / length)
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def print_phases(phases: list[dict], args: TitanMoEArgs, length: int) -> None:
    """Each phase's start and peak, and for a layer's backward the plan's recompute of it."""
    print(f"  {'phase':<20} {'start GiB':>9} {'peak GiB':>9} {'rise GiB':>9} "
          f"{'plan recompute':>14}")
    for p in phases:
        plan = ""
        if p["phase"].startswith("backward, layer "):
            layer_id = int(p["phase"].rsplit(" ", 1)[1])
            saved = layer_activation_bytes(args, layer_id, 1, length)
            p["plan_recompute_gib"] = saved.recompute / GIB
            plan = f"{p['plan_recompute_gib']:14.2f}"
        print(f"  {p['phase']:<20} {p['start_gib']:9.2f} {p['peak_gib']:9.2f} "
              f"{p['peak_gib'] - p['start_gib']:9.2f} {plan}")


def main() -> None:
    # Read at CUDA's first allocation, so set before the model is built.
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke run: debug flavor, 2 layers")
    parser.add_argument("--flavor", default="proxy")
    parser.add_argument("--n-layers", type=positive, default=None)
    parser.add_argument("--lengths", default=None,
                        help=f"comma-separated sequence lengths (default {LENGTHS}; --tiny: "
                             f"{TINY_LENGTHS})")
    parser.add_argument("--doc-len", type=positive, default=65536, help="tokens per document")
    parser.add_argument("--loss-chunk", type=positive, default=CHUNK,
                        help="positions per chunk of the loss (training.loss_chunk)")
    parser.add_argument("--moe-chunk", type=non_negative, default=0,
                        help="tokens a MoE chunk (titan_moe.moe_token_chunk; 0: unchunked)")
    parser.add_argument("--seq-segment", type=non_negative, default=0,
                        help="positions a KDA segment and tokens a dense-FFN chunk, a multiple "
                             "of 64 (titan_moe.seq_segment; 0: whole sequences)")
    parser.add_argument("--ac", choices=("full", "none"), default="full",
                        help="activation checkpointing of every decoder layer, or none")
    parser.add_argument("--attn-res-sink", action="store_true",
                        help="the blocks' gradients summed in place (titan_moe.attn_res_grad_sink)")
    parser.add_argument("--norm-saves-output", action="store_true",
                        help="the layers' input norms save their outputs, not their inputs "
                             "(titan_moe.norm_saves_output)")
    parser.add_argument("--offload", action="store_true",
                        help="saved layer inputs to pinned host memory (needs --ac full)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile per sublayer with the trainer's passes (the plan "
                             "assumes it: fused SiTU-GLU and RMSNorm save only their inputs)")
    parser.add_argument("--phase-peaks", action="store_true",
                        help="the first warmup step (or one more step) per length records its "
                             "peak memory by phase (forward, each layer's backward) beside the "
                             "plan's recompute of that layer")
    parser.add_argument("--warmup", type=non_negative, default=1)
    parser.add_argument("--iters", type=positive, default=1)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    if args.tiny:
        args.flavor, args.n_layers = "debug", 2
        args.warmup, args.doc_len, args.loss_chunk = 0, 96, 64
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    try:
        lengths = [int(n) for n in (args.lengths or (TINY_LENGTHS if args.tiny else LENGTHS))
                   .split(",")]
    except ValueError:
        parser.error(f"--lengths must be comma-separated integers, got {args.lengths!r}")
    if args.loss_chunk < 1 or any(n < 1 for n in lengths):
        parser.error("--lengths and --loss-chunk must be positive integers")
    if args.offload and args.ac != "full":
        parser.error("--offload needs --ac full")
    try:
        model_cfg = model_args(args.flavor, args.n_layers, args.moe_chunk, args.seq_segment,
                               args.attn_res_sink, args.norm_saves_output)
    except ConfigError as error:
        parser.error(str(error))
    model = build(model_cfg, device, dtype, args.ac, args.compile)
    loss_fn = ChunkedCrossEntropy(model.output, args.loss_chunk)
    print(f"{'seq_len':>9} {'status':>6} {'step s':>9} {'us/token':>9} {'max GiB':>8} "
          f"{'GiB/1K tok':>10} {'plan GiB':>8} {'plan/max':>8}")
    rows = []
    for length in lengths:
        r = measure(model, loss_fn, length, args.doc_len, device, args.warmup, args.iters,
                    args.offload, args.phase_peaks)
        r["seq_segment"] = args.seq_segment
        r["planned_peak_gib"] = planned_peak_gib(model_cfg, length, args.ac, args.loss_chunk,
                                                 args.offload)
        if "max_memory_allocated_gib" in r:
            r["planned_over_measured"] = r["planned_peak_gib"] / r["max_memory_allocated_gib"]
        rows.append(r)
        print(f"{r['seq_len']:>9} {r['status']:>6} {r.get('step_s', float('nan')):>9.3f} "
              f"{r.get('us_per_token', float('nan')):>9.2f} "
              f"{r.get('max_memory_allocated_gib', float('nan')):>8.2f} "
              f"{r.get('gib_per_1k_tokens', float('nan')):>10.4f} "
              f"{r['planned_peak_gib']:>8.2f} {r.get('planned_over_measured', float('nan')):>8.3f}",
              flush=True)
        if "error" in r:
            print(f"  {r['error']}")
        if "phases" in r:
            print_phases(r["phases"], model_cfg, length)
        if args.out:  # after every length, so a crash keeps the rows measured so far
            with open(args.out, "w") as f:
                json.dump({"environment": environment(), "flavor": args.flavor,
                           "device": device, "ac": args.ac,
                           "cuda_alloc_conf": os.environ["PYTORCH_CUDA_ALLOC_CONF"],
                           "offload": args.offload, "loss_chunk": args.loss_chunk,
                           "moe_chunk": args.moe_chunk, "seq_segment": args.seq_segment,
                           "attn_res_sink": args.attn_res_sink,
                           "norm_saves_output": args.norm_saves_output,
                           "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
