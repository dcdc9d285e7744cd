"""Reading an HTTP request body with a cap (gateway.max_body_bytes), so an oversized body is
refused before it is held in memory: at once when its Content-Length says so, and as soon as
the bytes read pass the cap otherwise (chunked transfer, or a Content-Length that lies low,
which the HTTP server cuts off anyway)."""

from __future__ import annotations

from starlette.requests import Request

from pipeline.api.errors import body_too_large


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit, None)
        chunks.append(chunk)
    return b"".join(chunks)
