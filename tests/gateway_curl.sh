#!/usr/bin/env bash
# The README's curl commands against a running gateway, as a test runs them:
#   tests/gateway_curl.sh BASE_URL BODY_FILE
# prints the health check's status, then the streamed Server-Sent Events of the chat request
# in BODY_FILE (curl -N: each event as it arrives), then the status codes of a malformed body
# and of an unknown model. The caller checks the output.
set -euo pipefail
base=$1 body=$2

curl -sS -o /dev/null -w 'health %{http_code}\n' "$base/health"
curl -sS -N --fail-with-body "$base/v1/chat/completions" \
  -H 'Content-Type: application/json' --data-binary @"$body"
curl -sS -o /dev/null -w 'malformed %{http_code}\n' "$base/v1/chat/completions" \
  -H 'Content-Type: application/json' -d '{"messages": ['
curl -sS -o /dev/null -w 'unknown-model %{http_code}\n' "$base/v1/completions" \
  -H 'Content-Type: application/json' -d '{"model": "no-such-model", "prompt": "hi"}'
