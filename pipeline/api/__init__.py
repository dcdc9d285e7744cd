"""The OpenAI-compatible HTTP API: `openai` (the wire format as pure functions: requests in,
`Submit` out; chunks and results in, OpenAI chunks, responses and errors out) and `server`
(the Starlette app on the pipeline's trio client). A new endpoint is a route in `server` with
its mapping in `openai`."""
