#!/usr/bin/env bash
# Every GPU check and benchmark in one go, for one lease of a GPU machine:
#   bench/run_gpu.sh [OUT_DIR [STEP ...]]   (default: outputs/bench-<date>, every step)
# Naming steps (gpu_tests, kda, moe, ...: the names below) runs only those, in this file's order,
# so one device call of at most 10 minutes can take a few of them.
# Runs the `gpu`-marked tests, then every benchmark of bench/ (each issue's GPU figures); each
# step's log and JSON land in OUT_DIR and a failing step does not stop the next; each step is
# capped at STEP_TIMEOUT seconds (default 900). Set TRITON_CACHE_DIR to a kept folder: fla
# autotunes for minutes at every new head count and kernel variant.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-outputs/bench-$(date +%Y%m%d-%H%M)}
shift $(( $# > 0 ? 1 : 0 ))
only=" $* "
mkdir -p "$out"
export PYTHONUNBUFFERED=1
status=0
step() {
    local name=$1
    shift
    [[ "$only" == "  " || "$only" == *" $name "* ]] || return 0
    echo "=== $name"
    timeout "${STEP_TIMEOUT:-900}" "$@" 2>&1 | tee "$out/$name.log"
    local rc=${PIPESTATUS[0]}
    [[ $rc -eq 0 ]] || { echo "=== $name failed (exit $rc)"; status=1; }
}
# fla's configs for this GPU first (fla autotunes for minutes per kernel variant without them;
# commit what it writes under titan_moe/ops/kda/fla_configs/).
step tune_fla python3 scripts/tune_fla_kda.py
# Stacks every 120 s (pytest's own faulthandler; a dump_traceback_later set elsewhere is
# cancelled by pytest), and a test past its limit ends the run with its stack (thread method:
# the signal method cannot interrupt a test stuck in a Triton or Inductor compile).
step gpu_tests python3 -m pytest -m gpu tests -p no:cacheprovider -rfE --timeout 600 \
    --timeout-method=thread -o faulthandler_timeout=120
# The KDA op's own GPU tests alone (a minute with pytest-xdist), before its benchmarks.
step kda_tests python3 -m pytest -m gpu tests/gpu/test_kda_triton_cuda.py -p no:cacheprovider \
    -rfE -n 4 --dist load
step kda_compile python3 bench/kda_compile.py --out "$out/kda_compile.json"
step kda python3 bench/kda.py --profile --out "$out/kda.json"
# Issue 19: each of ours' kernels alone at the proxy shape, at 2/4/8 warps, 1-3 stages (the scans
# 2-3: see bench/kda_kernels.py), bf16 and tf32 operands (the op's own settings beside each
# launch's fastest).
step kda_kernels python3 bench/kda_kernels.py --out "$out/kda_kernels.json"
step attn_res python3 bench/attn_res.py --out "$out/attn_res.json"
step short_conv python3 bench/short_conv.py --out "$out/short_conv.json"
step moe_dispatch python3 bench/moe_dispatch.py --out "$out/moe_dispatch.json"
step qb_route python3 bench/qb_route.py --out "$out/qb_route.json"
step moe python3 bench/moe.py --out "$out/moe.json"
step router_precision python3 bench/router_precision.py --out "$out/router_precision.json"
# Issue 22: compiled, full AC; with the saved layer inputs offloaded, the MoE layers in token
# chunks and KDA, MLA and the dense FFN in segments, the plan expects 256K at 37.9 GiB
# (measured 51.0 while the chunked MoE layers compiled whole, 42.8 on the H100 while the
# segmented mixers did: each KDA layer's backward rose 20.7 GiB, the plan's 13.6; now both
# compiled per piece, expected about 37), 512K to fit one H200 (68.7 GiB; it ran out of memory
# at 75.8 on the H100) and 1M not (130.4 GiB: an MLA layer's last segment's keys and values
# over the whole prefix, and the residual gradients); each row carries planned / measured (its
# peak the largest over the phases), and its peak memory by phase (--phase-peaks) beside the
# plan's.
step long_context python3 bench/long_context.py --compile --offload --moe-chunk 65536 \
    --seq-segment 65536 --lengths 8192,65536,262144,524288,1048576 --phase-peaks \
    --out "$out/long_context.json"
# Issue 22.4: the stage chain at 8K -> 16K -> 32K -> 64K, 30 steps each, resuming stage to stage;
# the long-context evaluation of each stage lands in its TensorBoard folder.
step stage_chain bash -c "python3 scripts/short_stages.py --steps 30 --out $out/stages && \
    STAGE_DIR=$out/stages STAGES='8k 16k 32k 64k' scripts/run_stages.sh"
step long_context_nochunk python3 bench/long_context.py --compile \
    --lengths 8192,65536,262144 --out "$out/long_context_nochunk.json"
step compile python3 bench/compile.py --out "$out/compile.json"
# Batch 4 × 4096: the batch of issue 17's table since the tenth session (every row fits, the
# anchor at 120 GiB; an eager row that does not is kept as "out of memory").
step train_step python3 bench/step.py --batch 4 --profile trace --out "$out/step.json"
step trace_gaps python3 bench/trace_gaps.py "$out/trace-text-compiled-cudagraphs.json.gz"
# The trainer as users run it: compiled with CUDA graphs by default; the time to its first step
# is read off the log (run it first in a fresh machine, without a carried Triton cache, for the
# cold figure).
step run_train env CONFIG_FILE=configs/proxy.toml ./run_train.sh --training.steps 100 \
    --checkpoint.no_enable --job.dump_folder "$out/run_train"
# The same with the batches loaded in a worker process (the main process loaded them between
# steps, 13 ms a batch on the dev host, while the GPU ran the optimizer step).
step run_train_workers env CONFIG_FILE=configs/proxy.toml ./run_train.sh --training.steps 100 \
    --checkpoint.no_enable --training.dataloader.num_workers 1 \
    --job.dump_folder "$out/run_train_workers"
# Where the trainer's step differs from bench/step.py's: its step 30 profiled (torchtitan's
# profiler), the GPU's idle gaps and what the host did in them.
step run_train_profile env CONFIG_FILE=configs/proxy.toml ./run_train.sh --training.steps 31 \
    --checkpoint.no_enable --profiling.enable_profiling --profiling.profile_freq 30 \
    --job.dump_folder "$out/run_train_profile"
step run_train_gaps bash -c "python3 bench/trace_gaps.py $out/run_train_profile/profile_traces/iteration_30/rank0_trace.json; python3 bench/trace_host.py $out/run_train_profile/profile_traces/iteration_30/rank0_trace.json"
step plan_validate python3 -m titan_moe.plan --config configs/proxy.toml --validate --out "$out/plan.json"
step float8_tests python3 -m pytest -m gpu tests/gpu/test_float8_cuda.py -p no:cacheprovider -rfE
# Issue 21: which of the proxy's converted linears gain from float8, per recipe, and their sum.
step float8_linear python3 bench/float8_linear.py --recipes rowwise,tensorwise \
    --out "$out/float8_linear.json"
step float8_training python3 bench/float8_training.py --steps 300 --compile --out "$out/float8_training.json"
# Issue 23.3: TTFT and compiled, CUDA-graphed decode at 1K..512K; one step per batch size (one
# compile each, then a graph capture per context), both merged into one JSON. Batch 8 at 512K
# prefills for about 6 minutes on an H100 (42.6 s at batch 1, 2026-12-06).
step generate_b1 python3 bench/generate.py --batches 1 --out "$out/generate.json"
step generate_b8 python3 bench/generate.py --batches 8 --out "$out/generate.json"
# Issue 23.4: one GRPO update of the proxy (compiled rollouts, sandboxed Python tools) from a
# 20-step checkpoint; the checkpoint (model and optimizer, about 48 GB) stays out of OUT_DIR.
step rl_proxy_checkpoint env CONFIG_FILE=configs/proxy.toml ./run_train.sh --training.steps 20 \
    --job.dump_folder /tmp/titan_moe_proxy
step rl_proxy env CONFIG_FILE=configs/rl_proxy.toml scripts/run_rl.sh \
    --model.checkpoint /tmp/titan_moe_proxy/checkpoint --output.dump_folder "$out/rl_proxy"
echo "results in $out"
exit $status
