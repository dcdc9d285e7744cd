"""The cores of the model lanes, synchronous and I/O-free: `Verifier` (target model, KV caches,
acceptance rule, batching, chunked prefill) and `DraftServer` (every drafter, one per request).
Their processes (lanes/verify.py, lanes/draft.py) are short loops around them."""
