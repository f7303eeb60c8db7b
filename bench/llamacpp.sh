#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-bench for the benchmark
# comparisons (bench/serve_compare.py, bench/runtimes.py). Not part of the default set-up.
#
# Source: the llama-cpp-python sdist from PyPI (it vendors llama.cpp in vendor/llama.cpp),
# fetched with pip's ordinary client. Portable x86-64 build with AVX2/FMA/F16C (a
# -march=native build can die with an illegal instruction on the benchmark hosts).
#
# Idempotent: re-running skips the download/extract/configure/build steps already done.
# Usage: [LLAMACPP_JOBS=2] [LLAMACPP_NICE=10] [LLAMACPP_ISA=avx2|avx512] bench/llamacpp.sh [--print]
#   (--print: only print the binary dir, exit 1 if not built)
# LLAMACPP_ISA=avx512 (into build/llamacpp-avx512/) adds the AVX512 (F, VNNI, BF16) kernels, for
# hosts that have them (check /proc/cpuinfo): the anchor on such a host, where torch's oneDNN
# dispatches those instructions at run time. The default avx2 build runs everywhere.
# Output: build/llamacpp[-avx512]/bin/{llama-server,llama-quantize,llama-bench}; the last line
# printed is the bin directory.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
ISA="${LLAMACPP_ISA:-avx2}"
case "$ISA" in
  avx2) OUT="$ROOT/build/llamacpp"; ISA_FLAGS=() ;;
  avx512) OUT="$ROOT/build/llamacpp-avx512"
          ISA_FLAGS=(-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON) ;;  # no AMX: its tile instructions raised SIGILL here (the kernel grants no tile state)
  *) echo "LLAMACPP_ISA must be avx2 or avx512, got $ISA" >&2; exit 2 ;;
esac
BASE="$ROOT/build/llamacpp"  # the source, its sdist and SOURCE are shared by both ISA builds
SRC="$BASE/src"
BUILD="$OUT/build"
BIN="$OUT/bin"
JOBS="${LLAMACPP_JOBS:-2}"   # parallel compile jobs
NICE="${LLAMACPP_NICE:-10}"  # niceness of the compile (10: stay out of the way of other jobs)
TARGETS=(llama-bench llama-quantize llama-server)  # small tools first; the server also builds mtmd

have_all() { for t in "${TARGETS[@]}"; do [ -x "$BIN/$t" ] || return 1; done; }

if [ "${1:-}" = "--print" ]; then
  have_all || { echo "llama.cpp not built: run bench/llamacpp.sh" >&2; exit 1; }
  echo "$BIN"; exit 0
fi
if have_all; then echo "llama.cpp already built"; echo "$BIN"; exit 0; fi

mkdir -p "$OUT"
if [ ! -f "$SRC/CMakeLists.txt" ]; then
  DL="$BASE/sdist"
  mkdir -p "$DL"
  if ! ls "$DL"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "${PIP:-pip}" download --no-deps --no-binary :all: llama-cpp-python -d "$DL"
  fi
  TARBALL="$(ls "$DL"/llama_cpp_python-*.tar.gz | head -n1)"
  TMP="$BASE/extract"
  rm -rf "$TMP"; mkdir -p "$TMP"
  tar -xzf "$TARBALL" -C "$TMP"
  rm -rf "$SRC"
  mv "$TMP"/llama_cpp_python-*/vendor/llama.cpp "$SRC"
  echo "$(basename "$TARBALL")" > "$BASE/SOURCE"
  rm -rf "$TMP"
fi

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON "${ISA_FLAGS[@]}" \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON
fi
nice -n "$NICE" cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"
mkdir -p "$BIN"
for t in "${TARGETS[@]}"; do cp -f "$BUILD/bin/$t" "$BIN/$t"; done
echo "llama.cpp ($ISA) built from $(cat "$BASE/SOURCE" 2>/dev/null || echo vendored source)"
echo "$BIN"
