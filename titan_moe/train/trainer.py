"""Train a titan_moe model with torchtitan's Trainer, on CUDA (nccl) or CPU (gloo).

    python -m titan_moe.train --job.config_file configs/debug.toml [--section.key value ...]
    CONFIG_FILE=configs/debug.toml NGPU=2 ./run_train.sh [--section.key value ...]

One optimizer step = torchtitan's step, then every QuantileBalancer.step() (spec §6), whose
metrics join the logged ones. Logged per log step (TensorBoard with --metrics.enable_tensorboard):
loss, grad norm, tokens/s per device, achieved TFLOPS, MFU = achieved / peak FLOPS (CUDA only:
there is no meaningful peak on CPU), peak memory (CUDA allocator, or process RSS on CPU),
`moe/*` from Quantile Balancing, and histograms of the relative expert load (load / mean load)
and of the QB biases. `[profiling] enable_profiling = true` writes Chrome/Perfetto traces.

A step whose loss or grad norm is not finite is skipped and counted (`train/skipped_steps`);
`training.max_consecutive_skipped_steps` in a row stop the run, and no checkpoint is saved from
non-finite weights (step_guard.py). With the fused optimizer (the default) the clip is applied
inside the optimizer kernel and the skip decided on the device; the host learns of a skipped step
one step later, or at the next log step or checkpoint save.

`parallelism.pipeline_parallel_degree` = pp > 1: the model runs as pipeline stages cut on AttnRes
block boundaries (parallel/pipeline_schedule.py; README "Pipeline parallelism"), the loss and
gradients are the non-pipelined step's (with `training.loss_chunk`, the last stage's loss is
the chunked one), Quantile Balancing runs per stage and its metrics are gathered over the
pipeline ranks. `validation.enable` runs the validation batches through the schedule's
forward-only eval with the same loss (validator.py).

`training.loss_chunk` > 0: the loss is the chunked LM-head cross-entropy (chunked_loss.py), the
[T, vocab] logits are never whole. `parallelism.context_parallel_degree` = cp > 1: each rank of a
cp group trains on its contiguous slab of the group's rows (context_parallel.shard_batch); the
losses are slab sums over the global token count, summed over dp x cp for the log, the
gradients summed by FSDP over its fsdp dim (dp_shard x cp) and the QB histograms over dp x cp.
torchtitan's `global_max_loss` divides a rank's loss by the token count of its whole rows, so
under CP it reads about 1/cp of the largest slab mean; `global_avg_loss` is exact.
"""

import contextlib
import logging
import math
import os
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.elastic.multiprocessing.errors import record
from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.components.loss import build_cross_entropy_loss
from torchtitan.components.lr_scheduler import build_lr_schedulers
from torchtitan.components.metrics import LoggerContainer, MetricsProcessor, TensorBoardLogger
from torchtitan.components.tokenizer import BaseTokenizer
from torchtitan.config import JobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.train_spec import TrainSpec, get_train_spec, register_train_spec
from torchtitan.tools.logging import init_logger, logger

from titan_moe.data.multimodal import build_multimodal_dataloader
from titan_moe.data.tokenizer import build_tokenizer
from titan_moe.eval.long_context import NeedleSpec, long_context_metrics
from titan_moe.eval.multimodal import digit_accuracy
from titan_moe.model.args import FLAVORS
from titan_moe.model.flops import CountedTitanMoEArgs
from titan_moe.model.model import TitanMoE
from titan_moe.ops.static_documents import (
    TOKENS_PER_SEQUENCE,
    graph_sequence_bound,
    sequence_starts,
)
from titan_moe.parallel.context_parallel import shard_batch
from titan_moe.parallel.parallelize import parallelize_titan_moe
from titan_moe.parallel.pipeline import stage_inputs
from titan_moe.parallel.pipeline_schedule import pipeline_titan_moe, schedule_loss
from titan_moe.train.checkpoint_verify import VerifiedCheckpoints
from titan_moe.train.chunked_loss import ChunkedCrossEntropy, hidden_from_head
from titan_moe.train.config import (
    MODEL_NAME,
    ConfigError,
    job_model_args,
    needle_lengths,
    parse_job_config_or_exit,
)
from titan_moe.train.optimizer import LoadBalancing, build_optimizers_with_quantile_balancing
from titan_moe.train.platform import PlatformTrainer, resolve_device_type, use_platform
from titan_moe.train.step_guard import FiniteStepGuard, check_finite_weights
from titan_moe.train.validator import build_validator


class TitanMoEMetricsProcessor(MetricsProcessor):
    """torchtitan's step metrics plus MoE routing health; MFU only where peak FLOPS is known."""

    def __init__(self, job_config: JobConfig, parallel_dims: ParallelDims, tag: str | None = None):
        super().__init__(job_config, parallel_dims, tag)
        self.peak_flops = self.gpu_peak_flops if math.isfinite(self.gpu_peak_flops) else None
        self.histogram_writer = _tensorboard_writer(self.logger)
        # Objects whose stats() counters are logged: the training dataset (images read / skipped,
        # bad documents skipped) and the step guard (skipped steps).
        self.counters: list[Any] = []

    def log(
        self,
        step: int,
        global_avg_loss: float,
        global_max_loss: float,
        grad_norm: float,
        extra_metrics: dict[str, Any] | None = None,
    ) -> None:
        elapsed = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (elapsed * self.parallel_dims.non_data_parallel_size)
        tflops = self.num_flops_per_token * tps / 1e12
        memory = self.device_memory_monitor.get_peak_stats()
        loading = sum(self.data_loading_times)
        metrics: dict[str, Any] = {
            "loss_metrics/global_avg_loss": global_avg_loss,
            "loss_metrics/global_max_loss": global_max_loss,
            "grad_norm": grad_norm,
            "throughput(tps)": tps,
            "tflops": tflops,
            "time_metrics/end_to_end(s)": elapsed / self.job_config.metrics.log_freq,
            "time_metrics/data_loading(s)": loading / max(len(self.data_loading_times), 1),
            "time_metrics/data_loading(%)": 100 * loading / elapsed,
            "memory/max_active(GiB)": memory.max_active_gib,
            "memory/max_active(%)": memory.max_active_pct,
            "memory/max_reserved(GiB)": memory.max_reserved_gib,
            "memory/max_reserved(%)": memory.max_reserved_pct,
            "memory/num_alloc_retries": memory.num_alloc_retries,
            "memory/num_ooms": memory.num_ooms,
        }
        mfu = ""
        if self.peak_flops:
            metrics["mfu(%)"] = 100 * tflops * 1e12 / self.peak_flops
            mfu = f"  mfu: {metrics['mfu(%)']:.2f}%"
        metrics.update(extra_metrics or {})
        for counter in self.counters:
            metrics.update(counter.stats())
        balancing = getattr(self.optimizers, "load_balancing", None)
        if balancing is not None:
            metrics.update(balancing.metrics)
            self._log_histograms(balancing, step)
        self.logger.log(metrics, step)

        c = self.color
        moe = f"  max_violation: {metrics['moe/max_violation']:.3f}" if (
            "moe/max_violation" in metrics) else ""
        logger.info(
            f"{c.red}step: {step:2}  {c.green}loss: {global_avg_loss:8.5f}  "
            f"{c.orange}grad_norm: {grad_norm:7.4f}  "
            f"{c.turquoise}memory: {memory.max_reserved_gib:5.2f}GiB"
            f"({memory.max_reserved_pct:.2f}%)  {c.blue}tps: {round(tps):,}  "
            f"{c.cyan}tflops: {tflops:,.3f}{c.magenta}{mfu}{moe}{c.reset}"
        )
        self.ntokens_since_last_log = 0
        self.data_loading_times.clear()
        self.time_last_log = time.perf_counter()
        self.device_memory_monitor.reset_peak_stats()

    def log_multimodal_eval(self, step: int, accuracy: float) -> None:
        """The multimodal evaluation, under its own tag apart from the text metrics."""
        self.logger.log({"mm_eval/digit_accuracy": accuracy}, step)
        logger.info(f"step: {step:2}  multimodal eval: digit accuracy {accuracy:.3f}")

    def _log_histograms(self, balancing: LoadBalancing, step: int) -> None:
        if self.histogram_writer is None:
            return
        for balancer in balancing.balancers:
            if balancer.expert_load is not None:
                load = balancer.expert_load.double()
                relative = load / load.mean(-1, keepdim=True).clamp(min=1e-12)
                self.histogram_writer.add_histogram("moe/expert_load_relative", relative, step)
            if balancer.routers:
                biases = torch.stack([r.expert_bias.detach().float() for r in balancer.routers])
                self.histogram_writer.add_histogram("moe/expert_bias", biases, step)


def _count_packs(offload: torch.autograd.graph.save_on_cpu) -> list[int]:
    """Counts, in the returned one-element list, the tensors `offload` packs from now on: the
    start-up log's evidence that the offload wraps what the step saves."""
    packed, pack = [0], offload.pack_hook

    def counted(tensor: torch.Tensor) -> Any:
        packed[0] += 1
        return pack(tensor)

    offload.pack_hook = counted
    return packed


def _tensorboard_writer(metric_logger: Any) -> Any:
    # torchtitan's loggers only write scalars; histograms go through its TensorBoard writer.
    loggers = metric_logger._loggers if isinstance(metric_logger, LoggerContainer) else []
    return next((lg.writer for lg in loggers if isinstance(lg, TensorBoardLogger)), None)


def build_metrics_processor(
    job_config: JobConfig,
    parallel_dims: ParallelDims,
    model_args: Any = None,
    tag: str | None = None,
) -> TitanMoEMetricsProcessor:
    """TrainSpec `build_metrics_processor_fn`."""
    return TitanMoEMetricsProcessor(job_config, parallel_dims, tag)


def build_dataloader(
    dp_world_size: int,
    dp_rank: int,
    tokenizer: BaseTokenizer | None,
    job_config: JobConfig,
    infinite: bool = True,
) -> ParallelAwareDataloader:
    """TrainSpec `build_dataloader_fn`: text, or text + images with the job's vision config."""
    vision = None
    if getattr(job_config.training, "image_data", ""):
        vision = job_model_args(job_config).vision_config()
        if vision is None:
            raise ConfigError("training.image_data is set but titan_moe.vision = 'none'; "
                              "choose a vision tower (debug, proxy, full)")
    return build_multimodal_dataloader(dp_world_size, dp_rank, tokenizer, job_config, vision,
                                       infinite)


def titan_moe_train_spec() -> TrainSpec:
    """Our TrainSpec: the model, its flavors with their FLOP count, parallelize, data, tokenizer."""
    return TrainSpec(
        model_cls=TitanMoE,
        model_args={name: CountedTitanMoEArgs(**vars(args)) for name, args in FLAVORS.items()},
        parallelize_fn=parallelize_titan_moe,
        pipelining_fn=pipeline_titan_moe,
        build_optimizers_fn=build_optimizers_with_quantile_balancing,
        build_lr_schedulers_fn=build_lr_schedulers,
        build_dataloader_fn=build_dataloader,
        build_tokenizer_fn=build_tokenizer,
        build_loss_fn=build_cross_entropy_loss,
        build_metrics_processor_fn=build_metrics_processor,
        build_validator_fn=build_validator,
    )


def register_titan_moe() -> None:
    """Register the "titan_moe" TrainSpec with torchtitan (once)."""
    try:
        get_train_spec(MODEL_NAME)
    except ValueError:
        register_train_spec(MODEL_NAME, titan_moe_train_spec())


class TitanMoETrainer(PlatformTrainer):
    """torchtitan's Trainer on our platform adapter, with the titan_moe TrainSpec registered.

    With `[eval] long_context = true` the last step's batch is also the long-context
    evaluation's corpus sample, evaluated after that step and logged at its step number.
    """

    def __init__(self, job_config: JobConfig):
        if job_config.model.name == MODEL_NAME:
            register_titan_moe()
        super().__init__(job_config)
        self.step_guard = FiniteStepGuard(
            self.optimizers, job_config.training.max_consecutive_skipped_steps)
        dataset = getattr(self.dataloader, "dataset", None)
        self.metrics_processor.counters = [
            c for c in (dataset, self.step_guard) if hasattr(c, "stats")]
        # torchtitan's train() calls checkpointer.save after every step; it saves when due.
        self._save_checkpoint = self.checkpointer.save
        self.checkpointer.save = self.save_checkpoint
        # Saves gain a manifest; loads take a step that verifies (checkpoint_verify.py).
        self.verified_checkpoints = VerifiedCheckpoints(self.checkpointer, self.model_args)
        self.last_batch: tuple[dict[str, torch.Tensor], torch.Tensor] | None = None
        compile_config = job_config.compile
        self.cudagraphs = (compile_config.enable and compile_config.cudagraphs
                           and "model" in compile_config.components
                           and self.device.type == "cuda")
        dims = self.parallel_dims
        if self.cudagraphs and (dims.fsdp_enabled or dims.ep_enabled):
            # FSDP's unsharded parameters are freed and allocated again every step: not at the
            # fixed addresses a graph replays (untested; refused until measured).
            raise ValueError("compile.cudagraphs runs on unsharded parameters only: set "
                             "data_parallel_shard_degree = 1 and expert_parallel_degree = 1, "
                             "or compile.cudagraphs = false")
        if self.cudagraphs and (self.gradient_accumulation_steps > 1 or dims.pp_enabled):
            # A micro-batch's replay would overwrite the gradients the last one left in the
            # graphs' memory before the optimizer reads them.
            raise ValueError(
                "compile.cudagraphs takes one micro-batch a step: got "
                f"{self.gradient_accumulation_steps} gradient-accumulation steps and pipeline "
                f"parallelism {'on' if dims.pp_enabled else 'off'}; set "
                "training.global_batch_size to local_batch_size x data-parallel degree, "
                "pipeline_parallel_degree = 1, or compile.cudagraphs = false")
        # The head sits on the last part: under PP, this rank's last stage when it is the
        # model's last (None on the other pipeline ranks).
        self.head = getattr(self.model_parts[-1], "output", None)
        chunk = job_config.training.loss_chunk
        if chunk and dims.pp_enabled:
            # The schedule holds the loss; only the rank with the last stage (and its head)
            # calls it. The other ranks' schedules keep the full-logits one, never called.
            if self.head is not None:
                schedule_loss(self.pp_schedule).loss_fn = ChunkedCrossEntropy(self.head, chunk)
                logger.info("pipeline loss: the last stage's chunked LM-head cross-entropy, "
                            f"{chunk} positions a chunk")
        elif chunk:
            # The validator keeps the full-logits loss: it runs the model outside the step.
            self.loss_fn = ChunkedCrossEntropy(self.head, chunk)
        if job_config.validation.enable and dims.pp_enabled:
            # Under PP the validator runs the schedule, whose last stage's loss is the one above.
            self.validator.head_returns_hidden = self.head_returns_hidden
        self.pipeline_offload_logged = False
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        self.cp_group = cp_mesh.get_group() if cp_mesh is not None else None

    def post_dataloading_process(self, input_dict, labels):
        """The batch as the model takes it: (tokens, labels, extra_inputs, extra_kwargs), under
        CP this rank's slab (torchtitan's own CP would shard for DTensor attention, ours is
        context_parallel.py's). doc_ids go in extra_kwargs, which torchtitan hands every
        pipeline stage (every layer's mixer reads them); the image inputs stay in extra_inputs,
        the first stage's only."""
        if self.cp_group is not None:
            input_dict, labels = shard_batch(input_dict, labels, self.cp_group)
        tokens, extra_inputs, extra_kwargs = stage_inputs(input_dict)
        return tokens, labels, extra_inputs, extra_kwargs

    def forward_backward_step(self, *, input_dict, labels, **kwargs) -> torch.Tensor:
        self.last_batch = (input_dict, labels)
        if self.cudagraphs and input_dict.get("doc_ids") is not None:
            check_graph_sequences(input_dict["doc_ids"])
        step = super().forward_backward_step
        if self.parallel_dims.pp_enabled:
            loss = self.pipeline_step(input_dict, labels, **kwargs)
        else:
            with self.activation_offload(), self.head_returns_hidden():
                loss = step(input_dict=input_dict, labels=labels, **kwargs)
        self.step_guard.add_loss(loss)
        return loss

    def activation_offload(self) -> contextlib.AbstractContextManager:
        """save_on_cpu with `training.activation_offload` (which needs full AC, config.py), else
        nothing. The checkpoints' own hooks sit inside it, so only what they keep (the layer
        inputs) and what is saved outside the layers goes to the host."""
        if not self.job_config.training.activation_offload:
            return contextlib.nullcontext()
        return torch.autograd.graph.save_on_cpu(pin_memory=self.device.type == "cuda")

    def head_returns_hidden(self) -> contextlib.AbstractContextManager:
        """With `training.loss_chunk`, the LM head returns its input (`hidden_from_head`) for
        the chunked loss to apply its weight; under PP only on the rank holding the last stage,
        the one with a head. Else nothing."""
        if not self.job_config.training.loss_chunk or self.head is None:
            return contextlib.nullcontext()
        return hidden_from_head(self.head)

    def pipeline_step(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor,
                      global_valid_tokens: torch.Tensor) -> torch.Tensor:
        """One batch through the pipeline schedule; the loss is sum(CE) / global tokens, summed
        over the micro-batches on the last stage's ranks (TokenMeanLoss scales inside the
        schedule, where torchtitan's pipelined step would backpropagate unscaled sums), 0 on the
        other ranks, which hold no loss (metrics are logged from the last stage). With
        `training.loss_chunk` the sum is the chunked cross-entropy's (set in __init__).

        With `training.activation_offload` the whole schedule step runs under save_on_cpu, as the
        step without PP does: under 1F1B several micro-batches' saves are alive at once, each
        packed when its forward saves it and unpacked by its own backward. The schedule keeps
        its stages' inputs and outputs by reference (received activations, outputs to send,
        the gradients it returns), never through saved tensors, so nothing it relies on changes
        identity. The first offloaded step logs, once per rank, how many tensors it packed (on
        torch 2.13 its count includes the schedule's shape inference, one more forward with
        autograd; torch 2.11's runs under no_grad and saves nothing)."""
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            input_dict, labels)
        offload = self.activation_offload()
        packed = _count_packs(offload) if (isinstance(offload, torch.autograd.graph.save_on_cpu)
                                           and not self.pipeline_offload_logged) else None
        schedule_loss(self.pp_schedule).tokens = global_valid_tokens
        first, last = self.pp_has_first_stage, self.pp_has_last_stage
        losses: list[torch.Tensor] | None = [] if last else None
        # With the chunked loss the last stage returns its normed hidden states, also in the
        # first step's shape inference, which runs inside step().
        with offload, self.train_context(), self.head_returns_hidden():
            # Every rank passes the doc_ids (extra_kwargs; all pp ranks load the same batch),
            # which the schedule cuts into micro-batches for each of its stages; the tokens and
            # image inputs only enter the first stage.
            self.pp_schedule.step(*((inputs,) if first else ()),
                                  **(extra_inputs if first else {}), **extra_kwargs,
                                  target=labels if last else None, losses=losses,
                                  return_outputs=False)
        if packed is not None:
            self.pipeline_offload_logged = True
            logger.info(f"activation offload: the pipeline step packed {packed[0]} saved tensors "
                        "to the host on this rank")
        if losses is None:
            return torch.zeros((), device=self.device)
        return torch.stack(losses).sum().detach().to(self.device)

    def save_checkpoint(self, curr_step: int, last_step: bool = False) -> None:
        """torchtitan's checkpointer.save, refusing non-finite weights when it would save. Before
        a save and after the last step the step guard counts its pending steps: a run of
        non-finite steps stops before its checkpoint, and none goes uncounted at the end."""
        saving = self.checkpointer._should_save(curr_step, last_step)
        if saving or last_step:
            self.step_guard.settle()
        if saving:
            check_finite_weights(self.model_parts, curr_step)
        self._save_checkpoint(curr_step, last_step)

    def train_step(self, data_iterator) -> None:
        self.step_guard.begin(self.step)
        if self.cudagraphs:  # the last step's graph outputs may be overwritten from here on
            torch.compiler.cudagraph_mark_step_begin()
        super().train_step(data_iterator)
        evaluation = getattr(self.job_config, "multimodal_eval", None)
        if evaluation is not None and evaluation.freq and self.step % evaluation.freq == 0:
            self.multimodal_eval()
        eval_config = getattr(self.job_config, "eval", None)
        if eval_config is not None and eval_config.long_context and (
                self.step == self.job_config.training.steps):
            self.evaluate_long_context()

    def multimodal_eval(self) -> None:
        """Digit accuracy (eval/multimodal.py) on every rank, logged to TensorBoard."""
        model = self.model_parts[0]
        accuracy = digit_accuracy(model, self.tokenizer, model.vision.args,
                                  self.job_config.multimodal_eval.images, self.device)
        self.metrics_processor.log_multimodal_eval(self.step, accuracy)

    def evaluate_long_context(self) -> dict[str, float]:
        eval_config, seq_len = self.job_config.eval, self.job_config.training.seq_len
        spec = NeedleSpec(tuple(needle_lengths(eval_config, seq_len)),
                          tuple(eval_config.needle_depths), eval_config.needle_trials)
        input_dict, labels = self.last_batch
        model = self.model_parts[0]
        with self.maybe_enable_amp:
            # Under CP the last batch is still the cp group's whole rows (the slabs are cut
            # in post_dataloading_process); the eval cuts and gathers its own.
            metrics = long_context_metrics(model, input_dict["input"], labels,
                                           input_dict.get("doc_ids"), spec,
                                           model.tok_embeddings.num_embeddings,
                                           group=self.cp_group)
        self.metrics_processor.logger.log(metrics, self.step)
        logger.info("long-context eval: " + "  ".join(f"{k.removeprefix('long_context/')}: "
                                                      f"{v:.4f}" for k, v in metrics.items()))
        return metrics


def check_graph_sequences(doc_ids: torch.Tensor) -> None:
    """Refuse a batch with more sequences (row starts plus document starts) than the CUDA-graphed
    document layout holds (compile.cudagraphs), naming its count and the bound."""
    batch, seq_len = doc_ids.shape
    count = int(sequence_starts(doc_ids).sum())
    bound = graph_sequence_bound(batch, seq_len)
    if count > bound:
        raise ValueError(
            f"the batch has {count} sequences (rows + document starts) and compile.cudagraphs "
            f"holds {bound} at most ({batch} x {seq_len} tokens: one per row plus one per "
            f"{TOKENS_PER_SEQUENCE} tokens); pack longer documents or set "
            "compile.cudagraphs = false")


@record
def run(job_config: JobConfig) -> None:
    """Build the trainer and train (or write a seed checkpoint), as torchtitan's main does."""
    use_platform(resolve_device_type(job_config.training.device))
    trainer = None
    try:
        trainer = TitanMoETrainer(job_config)
        if job_config.checkpoint.create_seed_checkpoint:
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer is not None:
            trainer.close()
        raise
    trainer.close()
    if torch.distributed.is_initialized():
        # Every rank reaches teardown before any destroys the group. Rank 1, which finishes
        # first (rank 0 still writes logs and files), was seen dying in gloo teardown (SIGSEGV,
        # std::terminate) in 2 of about 10 CPU test runs.
        # Several gloo ranks (torchrun's processes; a one-process run returns to its caller).
        gloo_peers = (torch.distributed.get_backend() == "gloo"
                      and torch.distributed.get_world_size() > 1)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        if gloo_peers:
            exit_past_gloo_threads()


def exit_past_gloo_threads() -> None:
    """Leave a finished gloo rank without Python's interpreter shutdown. A gloo worker thread
    still releasing its last work's tensors after the group is destroyed asks for the GIL during
    shutdown, and Python kills it through a C++ destructor that aborts ("terminate called
    without an active exception": caught under gdb in a 2-rank script, 2026-12-06; a plain exit
    crashed 4 of 50 pairs there, this one none). A CPU PP test's trainer rank died so on
    2026-12-06 after its run had finished. Call it once everything is written: here the
    checkpointer and the metrics (TensorBoard) are closed, and the logs are flushed below."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _single_process_env() -> None:
    """Let `python -m titan_moe.train` run without torchrun, as one process."""
    if "LOCAL_RANK" in os.environ:
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    for key, value in env.items():
        os.environ.setdefault(key, value)


def main(argv: Sequence[str] | None = None) -> None:
    init_logger()
    _single_process_env()
    job_config = parse_job_config_or_exit(sys.argv[1:] if argv is None else argv)
    run(job_config)

