#!/usr/bin/env bash
# Build llama.cpp's llama-server (the reference CPU server) for side-by-side benchmarks.
# Sources: the llama.cpp tree vendored in the llama-cpp-python sdist on PyPI (no other
# network needed). Needs cmake and a C++ compiler (apt-get install cmake g++).
# Prints the binary's path. Idempotent; ~10 minutes on 2 cores the first time.
#
#   LS=$(loadtest/llama_server.sh)
#   $LS -m model.gguf --host 127.0.0.1 --port 8080 -np 64 -c 16384 -t 2
set -euo pipefail
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/llama.cpp-0.3.36}
BIN=$DIR/llama.cpp/build/bin/llama-server
if [ ! -x "$BIN" ]; then
  mkdir -p "$DIR/dl"
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d "$DIR/dl" >&2
  tar xzf "$DIR/dl/llama_cpp_python-0.3.36.tar.gz" -C "$DIR/dl"
  rm -rf "$DIR/llama.cpp"; mv "$DIR/dl/llama_cpp_python-0.3.36/vendor/llama.cpp" "$DIR/llama.cpp"
  # GGML_NATIVE can emit instructions some VMs advertise but trap on (AMX): name the ISA instead.
  has() { grep -qw "$1" /proc/cpuinfo && echo ON || echo OFF; }
  (cd "$DIR/llama.cpp" && cmake -B build -DLLAMA_BUILD_SERVER=ON -DGGML_NATIVE=OFF \
    -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512="$(has avx512f)" \
    -DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)" \
    -DGGML_AVX512_BF16="$(has avx512_bf16)" -DGGML_AVX_VNNI="$(has avx_vnni)" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DCMAKE_BUILD_TYPE=Release >&2 \
    && cmake --build build --target llama-server -j"$(nproc)" >&2)
fi
echo "$BIN"
