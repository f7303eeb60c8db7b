#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-quantize and llama-bench for the benchmark
# comparisons (bench/serve_compare.py, bench/runtimes.py). Not part of the default set-up.
#
# Source: the llama-cpp-python sdist from PyPI (it vendors llama.cpp in vendor/llama.cpp),
# fetched with pip's ordinary client. Portable x86-64 build with AVX2/FMA/F16C (a
# -march=native build can die with an illegal instruction on the benchmark hosts).
#
# Idempotent: re-running skips the download/extract/configure/build steps already done.
# Usage: [LLAMACPP_JOBS=2] [LLAMACPP_NICE=10] bench/llamacpp.sh [--print]   (--print: only print the binary dir, exit 1 if not built)
# Output: build/llamacpp/bin/{llama-server,llama-quantize,llama-bench}; the last line printed
# is the bin directory.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
OUT="$ROOT/build/llamacpp"
SRC="$OUT/src"
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
  DL="$OUT/sdist"
  mkdir -p "$DL"
  if ! ls "$DL"/llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    "${PIP:-pip}" download --no-deps --no-binary :all: llama-cpp-python -d "$DL"
  fi
  TARBALL="$(ls "$DL"/llama_cpp_python-*.tar.gz | head -n1)"
  TMP="$OUT/extract"
  rm -rf "$TMP"; mkdir -p "$TMP"
  tar -xzf "$TARBALL" -C "$TMP"
  rm -rf "$SRC"
  mv "$TMP"/llama_cpp_python-*/vendor/llama.cpp "$SRC"
  echo "$(basename "$TARBALL")" > "$OUT/SOURCE"
  rm -rf "$TMP"
fi

if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  GEN=()
  command -v ninja >/dev/null && GEN=(-G Ninja)
  cmake -S "$SRC" -B "$BUILD" "${GEN[@]}" \
    -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON
fi
nice -n "$NICE" cmake --build "$BUILD" -j"$JOBS" --target "${TARGETS[@]}"
mkdir -p "$BIN"
for t in "${TARGETS[@]}"; do cp -f "$BUILD/bin/$t" "$BIN/$t"; done
echo "llama.cpp built from $(cat "$OUT/SOURCE" 2>/dev/null || echo vendored source)"
echo "$BIN"
