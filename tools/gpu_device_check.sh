#!/usr/bin/env bash
# The one prepared GPU check of issue 6 (docs/gpu.md): GPU-marked tests, then the benchmark, then as much of
# the rest of the suite as the time left allows; every step under its own timeout, logs under $OUT.
#
# 1. HERE (a machine with PyPI), once, from the repository root:
#        bash tools/gpu_device_check.sh --prepare
#    downloads Python 3.12 x86-64 wheels of the dependencies the GPU image lacks into .whl/ (ignored by git
#    through .git/info/exclude; about 2 MB). posix-ipc is the one the GPU tests and the IPC bench need.
# 2. ON THE DEVICE MACHINE (one call; the script stops itself after GPU_CHECK_BUDGET_S, default 480 s):
#        run(command="bash tools/gpu_device_check.sh", carry=[".whl"], timeout_s=560)
#    then read $OUT/summary.txt (the reply's files). To redo some steps on the still-warm machine:
#        run(command="GPU_CHECK_STEPS=bench bash tools/gpu_device_check.sh", carry=[".whl"], timeout_s=400)
#
# Steps (GPU_CHECK_STEPS, comma separated; default all, in this order):
#   env        nvidia-smi, python/torch/numba versions, /dev/shm                              (<= 30 s)
#   gpu-tests  pytest -m gpu over tests/ (kernels on the GPU, CUDA IPC between processes)       (<= 200 s)
#   bench      bench/gpu.py --quick -> bench.md, bench.json                               (<= 240 s)
#   suite      pytest -m "not gpu and not slow" over tests/, with whatever time is left
# Installs nothing from the network (there is none there): only the carried wheels, into /tmp/site.
# Files back (at most 8): summary.txt env.log wheels.log gpu-tests.log bench.log bench.md bench.json suite.log
set -u -o pipefail

cd "$(dirname "$0")/.."
PY=${PY:-python3}

if [[ "${1:-}" == "--prepare" ]]; then
    mkdir -p .whl
    grep -qxF "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
    platforms=()
    for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
             manylinux1_x86_64 manylinux_2_5_x86_64; do platforms+=(--platform "$p"); done
    # what the GPU image lacks (its package list: .library/device/KINDS.md), within setup.cfg's ranges
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        "${platforms[@]}" -d .whl \
        "posix-ipc>=1.1,<2" "orjson>=3.8,<4" "starlette>=0.40,<2" "hypercorn>=0.17,<0.19" "h2>=4,<5" \
        "hpack>=4,<5" "hyperframe>=6,<7" "priority>=2,<3" "wsproto>=1.2,<2" "gguf>=0.10,<0.20" || exit 1
    ls -l .whl
    du -sh .whl
    exit 0
fi

OUT=${OUT:-/tmp/gpu_device_check}
mkdir -p "$OUT"
BUDGET=${GPU_CHECK_BUDGET_S:-480}
STEPS=${GPU_CHECK_STEPS:-env,gpu-tests,bench,suite}
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
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
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
        --target /tmp/site .whl/*.whl > "$OUT/wheels.log" 2>&1
    log "wheels: rc=$? ($(ls .whl/*.whl | wc -l) carried)"
    export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
    log "WARNING: no .whl/ carried (run 'bash tools/gpu_device_check.sh --prepare' here first, then carry"
    log "         [\".whl\"]): tests needing posix_ipc (tests/gpu/test_cuda_ipc.py, the IPC bench) will fail"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

step env 30 bash -c '
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

step gpu-tests 200 $PY -m pytest -q -p no:cacheprovider -m gpu -rs --durations=15 --timeout=150 \
    --continue-on-collection-errors tests

step bench 240 $PY bench/gpu.py --quick --out "$OUT/bench.md" --json "$OUT/bench.json" \
    --tune-cache "$PDSERVE_AUTOTUNE_CACHE"

step suite 600 $PY -m pytest -q -p no:cacheprovider -m "not gpu and not slow" -rs --timeout=120 \
    --continue-on-collection-errors tests

log "done in $(( $(date +%s) - T0 ))s; files: $(cd "$OUT" && ls | tr '\n' ' ')"
