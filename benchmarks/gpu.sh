#!/usr/bin/env bash
# Every CUDA test and every GPU benchmark of hf_altparams, in one command, for a
# machine with a GPU (CI has none, so none of this runs there):
#
#   bash benchmarks/gpu.sh            # results under $OUT (default: ./gpu-results)
#   GPU_QUICK=1 bash benchmarks/gpu.sh   # the benchmarks' quick modes only
#   GPU_BUDGET_S=0 bash benchmarks/gpu.sh  # no time budget (default 540 s: later steps skipped)
#
# It writes few files, so that a remote runner can bring them all back:
#   $OUT/gpu.log          everything printed, step by step (environment first)
#   $OUT/cuda_tests.xml   pytest's JUnit report of the tests marked `cuda`
#   $OUT/results.tgz      every benchmark's JSON / markdown output
# Each step runs even if an earlier one failed; the exit code is the number of
# failed steps (0: all passed). Copy the tables from results.tgz into
# benchmarks/RESULTS.md with the machine named (the log's first lines name it).
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-$(pwd)/gpu-results}
RESULTS="$OUT/results"
mkdir -p "$RESULTS"
LOG="$OUT/gpu.log"
: >"$LOG"
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
QUICK=${GPU_QUICK:-0}
failed=0

# A lent GPU comes with minutes, not hours (one call may run at most 10 minutes): steps that would
# start after GPU_BUDGET_S seconds are skipped and named in the log, so the results so far are
# still packed. 0: no budget.
BUDGET=${GPU_BUDGET_S:-540}
skipped=0

step() {  # step NAME COMMAND...: run, log, count a failure
    local name=$1; shift
    if [ "$BUDGET" -gt 0 ] && [ "$SECONDS" -ge "$BUDGET" ]; then
        echo "=== [$name] skipped: ${SECONDS} s used of GPU_BUDGET_S=${BUDGET}" | tee -a "$LOG"
        skipped=$((skipped + 1))
        return
    fi
    echo "=== [$name] $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
    local start=$SECONDS
    "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    echo "=== [$name] exit $status after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
}

step environment "$PY" - <<'PY'
import platform, torch, accelerate, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| accelerate", accelerate.__version__,
      "| transformers", transformers.__version__)
print("cuda available:", torch.cuda.is_available(), "| devices:",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PY
command -v nvidia-smi >/dev/null && step nvidia-smi nvidia-smi

# 1. Every test marked `cuda` (setup.cfg's marker); the rest of the suite is CI's. Among them,
# tests/engine/test_fsdp2_cuda.py (the FSDP2 engine on one GPU) and
# tests/integrations/test_fsdp2_integrations.py, which runs PhasedAccelerator and the Trainer with FSDP2
# for real on one GPU (Accelerate and the Trainer choose FSDP2 themselves; on CPU the test forces it).
step cuda-tests "$PY" -m pytest -p no:cacheprovider -m cuda -q -rs --junitxml="$OUT/cuda_tests.xml" tests

# 2. Benchmarks on the GPU (each writes its JSON / markdown under $RESULTS).
# alternating.py: `hf_drop` (release="auto": no empty_cache between equal phases) against
# `hf_drop_release` (empty_cache at every switch) gives what empty_cache at a switch costs in
# the next step; `hf_*_before` are the previous defaults (release at every switch, two
# all-reduces). long_run.py: memory_allocated right after every switch must take one value per
# phase after the warm-up (no leak per switch), and the switch history stays bounded.
if [ "$QUICK" = 1 ]; then
    step alternating "$PY" benchmarks/alternating.py --devices cuda --gpus 1 --size-mib 64 --steps 12 \
        --scenarios single hf_drop hf_drop_release hf_drop_before hf_keep hf_keep_reducers --out "$RESULTS"
    step memory "$PY" benchmarks/memory.py --devices cuda --repeat 1 --out "$RESULTS"
    step long-run "$PY" benchmarks/long_run.py --device cuda --ranks 1 --switches 500 --warmup 100 --out "$RESULTS"
    step large-model "$PY" benchmarks/large_model.py --device cuda --quick --out "$RESULTS"
    step frozen-prefix "$PY" benchmarks/frozen_prefix.py --device cuda --samples 512 --seq 128 --batch 32 --out "$RESULTS"
    step fsdp2-memory "$PY" benchmarks/fsdp2_memory.py --device cuda --nproc 1 --width 2048 --out "$RESULTS"
else
    step alternating "$PY" benchmarks/alternating.py --devices cuda --gpus 1 --diagnose --repeats 3 --out "$RESULTS"
    # Eight layers per half: several buckets, so DDP's single first-iteration bucket after each
    # rebuild (hf_keep) can be set against the learned layout of a kept reducer (hf_keep_reducers).
    step alternating-layers "$PY" benchmarks/alternating.py --devices cuda --gpus 1 --layers 8 --repeats 3 \
        --scenarios single hf_keep hf_keep_reducers hf_drop hf_drop_release --out "$RESULTS/layers8"
    step memory "$PY" benchmarks/memory.py --devices cuda --out "$RESULTS"
    step long-run "$PY" benchmarks/long_run.py --device cuda --ranks 1 --switches 5000 --warmup 500 --out "$RESULTS"
    # Llama-2-7B shape, 24 GB emulated (set_per_process_memory_fraction), seq 512, batch 1, checkpointing
    step large-model "$PY" benchmarks/large_model.py --device cuda --out "$RESULTS"
    step frozen-prefix "$PY" benchmarks/frozen_prefix.py --device cuda --samples 4096 --seq 128 --batch 64 --out "$RESULTS"
    # FSDP2 (fully_shard, one unit per layer, bf16 MixedPrecisionPolicy), NCCL world size 1: peak
    # max_memory_allocated of per-step alternation (drop / offload) <= 1.02 x one half trained alone.
    step fsdp2-memory "$PY" benchmarks/fsdp2_memory.py --device cuda --nproc 1 --out "$RESULTS"
fi
# Where a switch's time goes on the GPU (one process, no all-reduce): printed into gpu.log.
step switch-profile "$PY" benchmarks/switch_profile.py --device cuda --size-mib 256 --top 25
# A switch on a model with hundreds of modules, reducer inputs by hf_altparams vs DDP's own walks.
step switch-inputs "$PY" benchmarks/switch_profile.py --device cuda --model bert --layers 24 --compare-inputs
# keep_reducers=1 against a reducer built at every switch, interleaved in one process (switch and step).
step switch-kept "$PY" benchmarks/switch_profile.py --device cuda --model bert --layers 24 --compare-kept

tar -C "$OUT" -czf "$OUT/results.tgz" results && rm -rf "$RESULTS"
echo "gpu.sh: $failed step(s) failed, $skipped skipped for time; outputs in $OUT" | tee -a "$LOG"
exit "$failed"
