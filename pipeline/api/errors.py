"""The HTTP API's one error type, in OpenAI's shape, which every module of the API raises and the
server turns into the response (pipeline/api/server.py); the decoding of a JSON body into its
typed struct, whose failures become such errors naming the field; and the pipeline's own refusals
(the orchestrator's error kinds) as HTTP statuses."""

from __future__ import annotations

import re
from typing import Any

import msgspec


class ApiError(Exception):
    """An error as OpenAI reports it: an HTTP status and {"error": {message, type, param, code}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers  # HTTP headers the response carries (Retry-After, Connection)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


_AT = re.compile(r"at `\$\.([^`\[]+)")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def decode_json(body: bytes, kind: type[Any]) -> Any:
    """Malformed JSON, a wrong type or a missing field: a 400 naming the field (msgspec says which)."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as exc:
        text = str(exc)
        found = _AT.search(text) or _MISSING.search(text)
        raise ApiError(400, f"invalid request: {text}", param=found.group(1) if found else None) from None
    except msgspec.DecodeError as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}", code="invalid_json") from None
    except RecursionError:  # an unknown field nested thousands deep: refused, never a 500
        raise ApiError(400, "the body's JSON nests too deeply", code="invalid_json") from None


# The orchestrator's ErrorReply kinds (and the client's "unavailable") as HTTP errors.
PIPELINE_ERRORS: dict[str, tuple[int, str, str | None]] = {
    "bad_request": (400, "invalid_request_error", None),
    "prompt_too_long": (400, "invalid_request_error", "context_length_exceeded"),
    "unavailable": (503, "server_error", "pipeline_unavailable"),
    "draining": (503, "server_error", "server_shutting_down"),  # SIGTERM: in-flight requests finish
    "server_shutdown": (503, "server_error", "server_shutdown"),  # the drain window ended first
    "storage_full": (503, "server_error", "storage_full"),  # the run directory's disk is full
    "unknown_request": (500, "server_error", "unknown_request"),
    "overloaded": (429, "server_error", "server_overloaded"),  # admission.max_running + max_queued reached
    "too_large": (413, "invalid_request_error", "request_too_large"),
}
# A refused request may be sent again this many seconds later (the Retry-After header of a 429): a
# queued request's turn comes as soon as any running one ends.
RETRY_AFTER_SECONDS = 1


def pipeline_error(kind: str, message: str, param: str | None = None) -> ApiError:
    """An orchestrator error reply (or a request that failed in the pipeline) as an ApiError;
    kinds not listed (internal, verification_failed, ...) are 500 server errors."""
    status, type_, code = PIPELINE_ERRORS.get(kind, (500, "server_error", kind))
    retry = status == 429 or kind in ("draining", "storage_full")  # later, or another instance
    headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if retry else None
    return ApiError(
        status, message, type=type_, code=code, param=param if status == 400 else None, headers=headers
    )


def body_too_large(limit: int, size: int | None) -> ApiError:
    """413 for a body over gateway.max_body_bytes; `size` None: it was cut off while being read.
    The connection closes: the rest of the body is never read."""
    told = f"of {size} bytes " if size is not None else ""
    return ApiError(
        413, f"the request body {told}is over this server's limit of {limit} bytes (gateway.max_body_bytes)",
        code="request_too_large", headers={"Connection": "close"},
    )  # fmt: skip
