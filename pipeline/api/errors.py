"""The HTTP API's one error type, in OpenAI's shape, which every module of the API raises and the
server turns into the response (pipeline/api/server.py); and the decoding of a JSON body into its
typed struct, whose failures become such errors naming the field."""

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
