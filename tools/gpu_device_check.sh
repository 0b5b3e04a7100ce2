#!/usr/bin/env bash
# The one prepared GPU check of issue 37 (docs/gpu.md): the GPU-marked tests, the engine on the GPU, the benchmark,
# then as much of the rest of the suite as the time left allows; every step under its own timeout, logs under $OUT.
#
# 1. HERE (a machine with PyPI and the embedded model), once, from the repository root:
#        bash tools/gpu_device_check.sh --prepare
#    downloads Python 3.12 x86-64 wheels of the dependencies the GPU image lacks into .whl/ (a few MB) and writes the
#    engine check's tiny models (a Llama and a DeepSeek-V2, bf16, SmolLM2's tokenizer; ~26 MB) into .gpu-models/;
#    both are ignored by git through .git/info/exclude.
# 2. ON THE DEVICE MACHINE (one call; the script stops itself after GPU_CHECK_BUDGET_S, default 470 s):
#        run(command="bash tools/gpu_device_check.sh", carry=[".whl", ".gpu-models"], timeout_s=540)
#    then read $OUT/summary.txt (the reply's files). To redo some steps on the still-warm machine:
#        run(command="GPU_CHECK_STEPS=engine bash tools/gpu_device_check.sh", carry=[".whl", ".gpu-models"], ...)
#
# Steps (GPU_CHECK_STEPS, comma separated; default all, in this order):
#   env        nvidia-smi, python/torch/numba versions, the carried wheels' install            (<= 40 s)
#   gpu-tests  pytest -m gpu over tests/ but the engine's (kernels and MMA tiles vs cuBLAS/SDPA, CUDA IPC)  (<= 120 s)
#   engine     tests/e2e/test_gpu_engine.py: pdserve serve --device cuda, greedy vs HF float32, a stuck
#              transfer timed out by the watchdog                                               (<= 200 s)
#   bench      bench/gpu.py --quick -> bench.md, bench.json                               (<= 150 s)
#   suite      pytest -m "not gpu and not slow" over tests/, with whatever time is left
# Installs nothing from the network (there is none there): only the carried wheels, into /tmp/site.
# Files back (8): summary.txt env.log gpu-tests.log engine.log bench.log bench.md bench.json suite.log
set -u -o pipefail

cd "$(dirname "$0")/.."
PY=${PY:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p .whl
    for d in /.whl/ /.gpu-models/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
    platforms=()
    for p in manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64 \
             manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux1_x86_64 manylinux_2_5_x86_64; do platforms+=(--platform "$p"); done
    # what the GPU image lacks (its package list: .library/device/KINDS.md), within setup.cfg's ranges
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl \
        "posix-ipc>=1.1,<2" "orjson>=3.8,<4" "starlette>=0.40,<2" "hypercorn>=0.17,<0.19" "h2>=4,<5" \
        "hpack>=4,<5" "hyperframe>=6,<7" "priority>=2,<3" "wsproto>=1.2,<2" "gguf>=0.10,<0.20" \
        "llguidance>=1.9,<1.10" "sniffio>=1.3,<2" || exit 1
    ls -l .whl
    rm -rf .gpu-models && $PY -m tests.gpu.tiny_families .gpu-models || exit 1
    du -sh .whl .gpu-models
    exit 0
fi

OUT=${OUT:-/tmp/gpu_device_check}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-470}
STEPS=${GPU_CHECK_STEPS:-env,gpu-tests,engine,bench,suite}
T0=$(date +%s)
SUMMARY="$OUT/summary.txt"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
export PDSERVE_AUTOTUNE_CACHE=/tmp/pdserve-autotune.json

log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$SUMMARY"; }
wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
left() { echo $(( T0 + BUDGET - $(date +%s) )); }

# step NAME CAP_S CMD...: run CMD with a timeout of min(CAP_S, time left - 10 s), output to $OUT/NAME.log
step() {
    local name=$1 cap=$2; shift 2
    wanted "$name" || return 0
    local limit; limit=$(left); limit=$(( limit - 10 ))
    (( limit > cap )) && limit=$cap
    if (( limit < 20 )); then log "SKIP $name: only $(left)s of the ${BUDGET}s budget left"; return 0; fi
    local cmd="$*"
    log "START $name (timeout ${limit}s): ${cmd:0:150}"
    local s; s=$(date +%s)
    timeout -k 10 "$limit" "$@" >> "$OUT/$name.log" 2>&1
    local rc=$?
    local why=""; (( rc == 124 || rc == 137 )) && why=" (TIMED OUT)"
    log "END $name rc=$rc$why in $(( $(date +%s) - s ))s; last lines:"
    tail -n 6 "$OUT/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
}

: > "$SUMMARY"
log "gpu_device_check: budget ${BUDGET}s, steps $STEPS, repo $(git rev-parse --short HEAD 2>/dev/null || echo '?')"

# carried wheels (never the network)
if compgen -G ".whl/*.whl" > /dev/null; then
    timeout 90 $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl > "$OUT/env.log" 2>&1
    log "wheels: rc=$? ($(ls .whl/*.whl | wc -l) carried)"
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    log "WARNING: no .whl/ carried (run 'bash tools/gpu_device_check.sh --prepare' here first, then carry"
    log "         [\".whl\"]): tests needing posix_ipc, starlette or hypercorn (the IPC tests, the engine) will fail"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -d .gpu-models ]]; then
    export GPU_CHECK_MODELS="$PWD/.gpu-models"
else
    log "WARNING: no .gpu-models/ carried: the engine step has no models (the embedded one is not on the device)"
fi

step env 40 bash -c '
    nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    '"$PY"' - <<EOF
import importlib, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, p.multi_processor_count, "SMs", p.total_memory >> 30, "GiB")
for mod in ("numba", "numba_cuda", "posix_ipc", "orjson", "transformers"):
    try:
        print(mod, getattr(importlib.import_module(mod), "__version__", "?"))
    except Exception as exc:
        print(mod, "MISSING", type(exc).__name__, exc)
from numba import cuda
print("numba.cuda available:", cuda.is_available())
cuda.detect()
EOF
    df -h /dev/shm; nproc; free -g'

step gpu-tests 120 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --durations=15 --timeout=100 \
    --continue-on-collection-errors --ignore=tests/e2e/test_gpu_engine.py tests

step engine 200 $PY -m pytest -q -p no:cacheprovider -rs --durations=10 --timeout=180 tests/e2e/test_gpu_engine.py

step bench 150 $PY bench/gpu.py --quick --out "$OUT/bench.md" --json "$OUT/bench.json" \
    --tune-cache "$PDSERVE_AUTOTUNE_CACHE"

step suite 600 $PY -m pytest -q -p no:cacheprovider -m "not gpu and not slow" -rs --timeout=120 \
    --continue-on-collection-errors tests

log "done in $(( $(date +%s) - T0 ))s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
