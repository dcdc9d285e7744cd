"""The decoding core, pure and in-process: what makes speculative output exact.

- `sampling`: temperature / top-k / top-p as probability rows, seeded draws;
- `acceptance`: the rejection-sampling rule as pure functions, with decision records;
- `adaptive`: choosing k from measured acceptance and costs;
- `speculation`: `Speculation`, the one validated home of drafter, k, k_max and the step limit;
- `session` (the accepted tokens' side), `target` (the KV cache and the verifier's random
  stream), `speculative` (the in-process step loop that joins them);
- `output`: EOS, stop strings, max tokens; `result`: the typed final `Result`;
- `drafters/`: one proposer per file (ngram, suffix, model, composite). `kinds` declares what each
  drafter is: whether it samples, and whether it needs the target's features or a draft model.
  Code asks `kinds` about a drafter and never compares its name. `registry` builds the drafters.
A new drafter is a file in `drafters/` plus its line in `drafters/kinds.py` and its factory in
`drafters/registry.py`.
"""
