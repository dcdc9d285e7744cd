"""Structured output: grammars that constrain what the target may emit (issue 15).

- `format`: the request's `response_format` (OpenAI's shape, plus a Lark/GBNF extension), checked
  and carried as canonical JSON text in `SamplingParams`;
- `compiler`: formats compiled by llguidance for one tokenizer (the only module that imports it);
- `matcher`: one request's place in its grammar: masks, advance, roll back, forced tokens;
- `rows`: the masks of a verify block (`mask_rows`) and `Constraint`, the verifier's grammar state;
- `drafting`: forced tokens proposed ahead of any drafter's.
Nothing is imported here, so `SamplingParams` can check a format without loading llguidance.
"""
