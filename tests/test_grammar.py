"""Structured output (issue 15): formats, the grammar matcher, verify-block masks, and decoding under a
grammar. Fast tests use the tiny model (a byte-level vocabulary, random weights: whatever it emits
is the grammar's doing); the slow ones the real default model."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.decoding.acceptance import residual
from pipeline.decoding.drafters import EMPTY, NoDraftSource, Proposal
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.grammar.compiler import CompiledGrammar, compile_format
from pipeline.decoding.grammar.drafting import ForcedFirst, after_forced
from pipeline.decoding.grammar.format import (
    MAX_FORMAT_CHARS,
    ResponseFormatError,
    canonical_response_format,
    parse_response_format,
)
from pipeline.decoding.grammar.matcher import GrammarViolation
from pipeline.decoding.grammar.rows import Constraint, mask_logits, mask_probs, mask_rows, mask_tree
from pipeline.decoding.sampling import SamplingParams, target_probs
from pipeline.decoding.speculative import decode
from pipeline.decoding.target import TargetState
from pipeline.decoding.tree import path
from pipeline.model import Model

from .grammar_cases import PERSON, TOOL_CALL
from .tinymodel import TinySpec, write_tiny_gguf

# Everything bounded, so even a random model's output must close within a few dozen tokens.
FLAGS = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "level": {"enum": ["low", "high"]},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["ok", "level", "n"],
    "additionalProperties": False,
}
SHORT = {
    "type": "object",
    "properties": {
        "a": {"type": "string", "maxLength": 5},
        "b": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
CHOICE = {
    "anyOf": [
        {
            "type": "object",
            "properties": {"kind": {"const": "x"}},
            "required": ["kind"],
            "additionalProperties": False,
        },
        {
            "type": "object",
            "properties": {"v": {"type": "null"}},
            "required": ["v"],
            "additionalProperties": False,
        },
    ]
}
TINY_SCHEMAS = {"flags": FLAGS, "short": SHORT, "choice": CHOICE}
BAD = 1  # <|im_start|>: a control token no grammar here allows


def schema_format(schema: dict, name: str = "s") -> str:
    text = canonical_response_format({"type": "json_schema", "json_schema": {"name": name, "schema": schema}})
    assert text is not None
    return text


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("grammar") / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(context=256))
    return Model.load(path)


@pytest.fixture(scope="module")
def flags_grammar(tiny) -> CompiledGrammar:
    return compile_format(tiny.tokenizer, schema_format(FLAGS), tiny.cfg.vocab_size)


# --- formats --------------------------------------------------------------------------------------


def test_formats_are_parsed_and_canonical():
    assert parse_response_format({"type": "text"}) is None and canonical_response_format(None) is None
    assert parse_response_format('{"type": "json_object"}').kind == "json_object"
    spec = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    fmt = parse_response_format(canonical_response_format(spec))
    assert fmt.kind == "json_schema" and fmt.schema == PERSON and fmt.name == "p"
    assert list(fmt.schema["properties"]) == list(PERSON["properties"])  # property order is the output's
    assert parse_response_format({"type": "grammar", "grammar": 'start: "a"'}).grammar == 'start: "a"'


@pytest.mark.parametrize(
    "bad",
    [
        "{not json", "[]", {"type": "xml"}, {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {}},
        {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}},
        {"type": "grammar", "grammar": " "}, "x" * (MAX_FORMAT_CHARS + 1),
    ],
)  # fmt: skip
def test_malformed_formats_name_the_field(bad):
    with pytest.raises(ResponseFormatError, match=r"^response_format "):
        parse_response_format(bad)


def test_sampling_params_carry_the_format_over_the_wire():
    params = SamplingParams(response_format=schema_format(FLAGS))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(params), type=SamplingParams) == params
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(response_format=params.response_format, ignore_eos=True)
    with pytest.raises(ValueError, match=r"^response_format"):
        SamplingParams(response_format='{"type": "nope"}')
    with pytest.raises(ValueError, match="leave it unset"):
        SamplingParams(response_format='{"type": "text"}')


def test_a_schema_the_library_refuses_fails_at_compile(tiny):
    for schema in ({"type": "objekt"}, {"$ref": "#/nowhere"}, {"type": "string", "pattern": "("}):
        with pytest.raises(ResponseFormatError, match=r"^response_format"):
            compile_format(tiny.tokenizer, schema_format(schema), tiny.cfg.vocab_size)


# --- the matcher ----------------------------------------------------------------------------------


def walk_tokens(tokenizer, document: str) -> list[int]:
    return tokenizer.encode(document)


def test_a_valid_document_is_allowed_token_by_token_and_ends_the_grammar(tiny, flags_grammar):
    matcher = flags_grammar.matcher()
    for token in walk_tokens(tiny.tokenizer, '{"ok": true, "level": "high", "n": 42}'):
        assert matcher.allowed_mask()[token] and not matcher.eos_allowed()
        matcher.advance(token)
    assert matcher.is_finished() and matcher.eos_allowed()
    assert np.flatnonzero(matcher.allowed_mask()).tolist() == [tiny.tokenizer.eos_id]
    assert matcher.forced_tokens() == [tiny.tokenizer.eos_id]


def test_a_forbidden_token_raises_and_changes_nothing(tiny, flags_grammar):
    matcher = flags_grammar.matcher()
    for token in walk_tokens(tiny.tokenizer, '{"ok": '):
        matcher.advance(token)
    before, position = matcher.allowed_mask(), matcher.position
    for bad in (*walk_tokens(tiny.tokenizer, "x"), BAD, tiny.tokenizer.eos_id, tiny.cfg.vocab_size + 3):
        with pytest.raises(GrammarViolation):
            matcher.advance(bad)
    assert matcher.position == position and np.array_equal(matcher.allowed_mask(), before)
    matcher.advance(walk_tokens(tiny.tokenizer, "t")[0])  # and it goes on
    assert matcher.position == position + 1


def test_end_of_sequence_rolls_back_as_one_token(tiny, flags_grammar):
    """llguidance does not count an EOS after a complete grammar: the wrapper must, or `rollback(1)`
    would undo the closing brace instead."""
    matcher, eos = flags_grammar.matcher(), tiny.tokenizer.eos_id
    for token in walk_tokens(tiny.tokenizer, '{"ok": false, "level": "low", "n": 7}'):
        matcher.advance(token)
    done = matcher.allowed_mask()
    matcher.advance(eos)
    matcher.advance(eos)
    matcher.rollback(2)
    assert np.array_equal(matcher.allowed_mask(), done) and matcher.is_finished()
    matcher.rollback(1)
    assert not matcher.is_finished() and matcher.allowed_mask()[walk_tokens(tiny.tokenizer, "}")[0]]


def test_forced_tokens_are_what_the_schema_fixes(tiny, flags_grammar):
    matcher = flags_grammar.matcher()
    forced = matcher.forced_tokens()
    # The first key is required and comes first. The space after the colon is forced too, but not
    # its token: " t" (of " true") is one token in this vocabulary, so it stays the model's choice.
    assert tiny.tokenizer.decode(forced) == '{"ok":'
    for token in forced:
        matcher.advance(token)
    assert matcher.forced_tokens() == []


def test_masks_are_padded_to_the_models_vocabulary(tiny):
    wide = tiny.cfg.vocab_size + 7
    matcher = compile_format(tiny.tokenizer, schema_format(FLAGS), wide).matcher()
    mask = matcher.allowed_mask()
    assert mask.shape == (wide,) and not mask[tiny.cfg.vocab_size :].any() and mask.any()


DOC = '{"ok": true, "level": "low", "n": 5}'


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rollback_restores_every_earlier_state(tiny, flags_grammar, data):
    tokens = [*walk_tokens(tiny.tokenizer, DOC), tiny.tokenizer.eos_id]
    reference = flags_grammar.matcher()
    expected = []
    for token in tokens:
        expected.append(reference.allowed_mask())
        reference.advance(token)
    expected.append(reference.allowed_mask())
    matcher = flags_grammar.matcher()
    for _ in range(6):  # a random walk forward and back through the document
        if data.draw(st.booleans()) and matcher.position < len(tokens):
            steps = data.draw(st.integers(1, len(tokens) - matcher.position))
            for token in tokens[matcher.position : matcher.position + steps]:
                matcher.advance(token)
        else:
            matcher.rollback(data.draw(st.integers(0, matcher.position)))
        assert np.array_equal(matcher.allowed_mask(), expected[matcher.position])


# --- verify-block masks ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(start=st.integers(0, 20), valid=st.integers(0, 8), tail=st.lists(st.integers(0, 266), max_size=4))
def test_mask_rows_stop_at_the_first_forbidden_draft(tiny, flags_grammar, start, valid, tail):
    tokens = walk_tokens(tiny.tokenizer, DOC)
    matcher = flags_grammar.matcher()
    for token in tokens[:start]:
        matcher.advance(token)
    drafts = [*tokens[start : start + valid], BAD, *tail]
    masks, allowed = mask_rows(matcher, drafts)
    assert allowed == min(valid, len(tokens) - start) and masks.shape == (allowed + 1, tiny.cfg.vocab_size)
    assert matcher.position == start  # where it was
    walker = flags_grammar.matcher()
    for row, token in enumerate(tokens[: start + allowed]):
        if row >= start:
            assert np.array_equal(walker.allowed_mask(), masks[row - start])
        walker.advance(token)


@st.composite
def trees(draw, tokens):
    """Random draft trees over the document's tokens, a few forbidden ones and some noise."""
    size = draw(st.integers(1, 10))
    parents = [draw(st.integers(-1, i - 1)) for i in range(size)]
    pool = st.sampled_from([*tokens[:12], BAD, 0, 40])
    return [draw(pool) for _ in range(size)], parents


def walk_path(grammar, tokens, route):
    """A fresh matcher's mask after the tokens of `route`, or None if the grammar forbids one."""
    matcher = grammar.matcher()
    for node in route:
        if not matcher.allowed_mask()[tokens[node]]:
            return None
        matcher.advance(tokens[node])
    return matcher.allowed_mask()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mask_tree_gives_each_allowed_node_the_mask_of_its_path(tiny, flags_grammar, data):
    tokens, parents = data.draw(trees(walk_tokens(tiny.tokenizer, DOC)))
    matcher = flags_grammar.matcher()
    masks, keep = mask_tree(matcher, tokens, parents)
    assert matcher.position == 0 and masks.shape == (len(keep) + 1, tiny.cfg.vocab_size)
    assert np.array_equal(masks[0], flags_grammar.matcher().allowed_mask())
    expected = {node: walk_path(flags_grammar, tokens, path(parents, node)) for node in range(len(tokens))}
    assert keep == [node for node, mask in expected.items() if mask is not None]
    for row, node in enumerate(keep, start=1):
        assert np.array_equal(masks[row], expected[node])


def test_cut_prunes_a_tree_below_a_forbidden_node(tiny, flags_grammar):
    first, second = walk_tokens(tiny.tokenizer, '{"')[:2]
    #         node:   0      1    2       3    4
    tokens = [first, BAD, second, 40, second]
    parents = [-1, -1, 0, 1, 2]  # BAD (1) and its child (3) go; node 4 ('"' after '{"') is forbidden too
    constraint = Constraint(flags_grammar.matcher())
    cut = constraint.cut(Proposal(tokens, None, "t", parents, [0.6, 0.4, 1.0, 1.0, 1.0]))
    assert cut.tokens == [first, second] and cut.parents is None and cut.shares == [0.6, 1.0]
    logits = np.zeros((len(tokens) + 1, tiny.cfg.vocab_size), np.float32)
    masked, _ = constraint.constrain(logits, tokens, None, parents)  # uncut: every row gets a usable mask
    assert all(np.isfinite(row).any() for row in masked)
    assert np.array_equal(np.isfinite(masked[2]), np.isfinite(masked[0]))  # BAD's row is its parent's


def test_constrain_masks_q_and_renormalises_p(tiny, flags_grammar):
    constraint = Constraint(flags_grammar.matcher())
    drafts = [*walk_tokens(tiny.tokenizer, '{"ok": '), BAD, 40]
    vocab = tiny.cfg.vocab_size
    logits = np.random.default_rng(0).standard_normal((len(drafts) + 1, vocab)).astype(np.float32)
    p = np.full((len(drafts), vocab), 1.0 / vocab)
    masked, p_masked = constraint.constrain(logits, drafts, p)  # uncut: rows past BAD repeat BAD's row
    masks, allowed = mask_rows(constraint.matcher, drafts)
    assert allowed == len(drafts) - 2 and masked.shape == logits.shape
    assert np.array_equal(np.isfinite(masked[: allowed + 1]), masks)
    assert np.array_equal(np.isfinite(masked[allowed + 1 :]), np.repeat(masks[-1:], 2, axis=0))
    np.testing.assert_allclose(p_masked.sum(axis=1), 1.0)
    assert np.array_equal(p_masked[:allowed] > 0, masks[:allowed])
    assert constraint.cut(Proposal(drafts)).tokens == drafts[:allowed]


@pytest.mark.parametrize("seed", range(3))
def test_masked_p_keeps_a_sampling_drafter_exact(tiny, flags_grammar, seed):
    """One draft x ~ p (the drafter knows no grammar): cut if forbidden, else kept with
    min(1, q'(x)/p'(x)) and replaced from norm(max(0, q' - p')). The emitted token is distributed
    exactly as q' (the masked target row) only because p' is p masked and renormalised."""
    rng = np.random.default_rng(seed)
    vocab = tiny.cfg.vocab_size
    mask = flags_grammar.matcher().allowed_mask() | (rng.random(vocab) < 0.2)  # a few dozen allowed ids
    q = target_probs(
        mask_logits(rng.standard_normal(vocab).astype(np.float32), mask), SamplingParams(temperature=1)
    )
    p = rng.dirichlet(np.full(vocab, 0.3))

    def emitted(p_used):
        dist = np.zeros(vocab)
        for x in np.flatnonzero(p):
            if not mask[x]:  # cut before the forward: the target samples the row itself
                dist += p[x] * q
                continue
            keep = min(1.0, q[x] / p_used[x])
            dist[x] += p[x] * keep
            dist += p[x] * (1 - keep) * residual(q, p_used, x)
        return dist

    np.testing.assert_allclose(emitted(mask_probs(p, mask)), q, atol=1e-12)
    assert not np.allclose(emitted(p), q, atol=1e-3)  # unmasked p would skew the output


def test_a_tree_hangs_below_the_forced_tokens():
    tree = Proposal([7, 8, 9], None, "ngram", [-1, -1, 1], [0.5, 0.5, 1.0])
    out = after_forced([3, 4], tree)
    assert out.tokens == [3, 4, 7, 8, 9] and out.parents == [-1, 0, 1, 1, 3]
    assert out.shares == [1.0, 1.0, 0.5, 0.5, 1.0] and out.drafter == "ngram"
    assert after_forced([3], Proposal([5, 6])).parents is None  # a chain stays a chain


def test_forced_first_puts_the_forced_tokens_ahead_of_the_drafter(tiny, flags_grammar):
    matcher, seen = flags_grammar.matcher(), []

    class Sampler:
        name = "model"

        def propose(self, context, k, tree=False, floor=0.0):
            seen.append(list(context))
            return Proposal([40] * k, np.full((k, tiny.cfg.vocab_size), 0.5, np.float32), "model")

    forced = matcher.forced_tokens()
    proposal = ForcedFirst(Sampler(), matcher).propose([9, 9], len(forced) + 2)
    assert proposal.tokens == [*forced, 40, 40] and seen == [[9, 9, *forced]]
    assert np.array_equal(proposal.probs[: len(forced)].argmax(axis=1), forced)
    assert proposal.probs[: len(forced)].sum() == len(forced) and (proposal.probs[len(forced) :] == 0.5).all()
    assert ForcedFirst(Sampler(), matcher).propose([9], 2).tokens == forced[:2] and len(seen) == 1


# --- decoding under a grammar (tiny model) --------------------------------------------------------


def run(model, params, drafter="none", k=None, source=None, tree=True):
    prompt = model.tokenizer.encode("Answer in JSON: the answer is")
    source = source or make_draft_source(drafter, model)
    return decode(model, prompt, params, source, k=0 if drafter == "none" else k, tree=tree)


@pytest.mark.parametrize("name", sorted(TINY_SCHEMAS))
def test_greedy_output_validates_and_is_the_same_with_every_drafter(tiny, name):
    params = SamplingParams(max_tokens=120, response_format=schema_format(TINY_SCHEMAS[name]))
    plain = run(tiny, params)
    assert plain.finish_reason == "stop" and plain.tokens[-1] == tiny.tokenizer.eos_id
    jsonschema.validate(json.loads(plain.text), TINY_SCHEMAS[name])
    for drafter, k in (("ngram", None), ("suffix", 4), ("auto", 8)):
        for tree in (True, False):
            assert run(tiny, params, drafter, k, tree=tree).tokens == plain.tokens, (drafter, tree)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32), temperature=st.sampled_from([0.7, 1.0, 1.5]), top_k=st.sampled_from([0, 20])
)
def test_seeded_output_validates_and_is_the_same_with_speculation(tiny, seed, temperature, top_k):
    fmt = schema_format(SHORT)
    params = SamplingParams(
        max_tokens=120, seed=seed, temperature=temperature, top_k=top_k, response_format=fmt
    )
    plain = run(tiny, params)
    assert plain.finish_reason == "stop"
    jsonschema.validate(json.loads(plain.text), SHORT)
    assert run(tiny, params, "ngram", 4).tokens == plain.tokens  # deterministic drafts: seed-exact


@pytest.mark.parametrize(
    ("grammar", "allowed"),
    [('start: "yes" | "no"', {"yes", "no"}), ('root ::= [0-9] [0-9] "!"', {f"{i:02d}!" for i in range(100)})],
    ids=["lark", "gbnf"],
)
def test_grammar_extension(tiny, grammar, allowed):
    fmt = canonical_response_format({"type": "grammar", "grammar": grammar})
    out = run(tiny, SamplingParams(max_tokens=20, response_format=fmt), "auto")
    assert out.finish_reason == "stop" and out.text in allowed


class Spy:
    """The model, recording the tokens of every forward."""

    def __init__(self, model):
        self.model, self.forwards = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward(self, cache, tokens, **kwargs):
        self.forwards.append(list(tokens))
        return self.model.forward(cache, tokens, **kwargs)

    def forward_batch(self, batch, **kwargs):
        self.forwards.extend(list(item[1]) for item in batch)
        return self.model.forward_batch(batch, **kwargs)

    def forward_features(self, batch, **kwargs):
        self.forwards.extend(list(item[1]) for item in batch)
        return self.model.forward_features(batch, **kwargs)


class OracleSource:
    """Proposes the true next token, then a forbidden one, then true tokens again."""

    name = "oracle"

    def __init__(self, prompt_length, truth):
        self.prompt_length, self.truth, self.with_bad = prompt_length, truth, 0

    def start(self, prompt, params, seed):
        return self

    def propose(self, context, k, tree=False, floor=0.0):
        at = len(context) - self.prompt_length
        if tree:  # the truth, and a forbidden sibling with a child of its own
            tokens = [*self.truth[at : at + 2], BAD, 40][:k]
            parents, shares = [-1, 0, -1, 2][: len(tokens)], [0.5, 1.0, 0.5, 1.0][: len(tokens)]
        else:
            tokens = [*self.truth[at : at + 1], BAD, *self.truth[at + 2 : at + k]][:k]
            parents = shares = None
        self.with_bad += BAD in tokens
        return Proposal(tokens, None, self.name, parents, shares) if tokens else EMPTY

    def accept(self, context):
        pass

    def finish(self, context):
        pass


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_forbidden_draft_is_cut_before_the_forward(tiny, tree):
    params = SamplingParams(max_tokens=120, response_format=schema_format(FLAGS))
    plain = run(tiny, params)
    spy, prompt_length = Spy(tiny), len(tiny.tokenizer.encode("Answer in JSON: the answer is"))
    source = OracleSource(prompt_length, plain.tokens)
    out = run(spy, params, "oracle", 4, source=source, tree=tree)
    assert out.tokens == plain.tokens
    steps = spy.forwards[1:]  # after the prefill
    assert source.with_bad > 0 and all(BAD not in rows for rows in steps)
    assert not tree or all(40 not in rows[1:] for rows in steps)  # the forbidden node's child went too
    assert out.stats.accepted > 0
    assert sum(len(rows) - 1 for rows in steps) == out.stats.drafted  # only the cut drafts were run


def test_target_state_constrains_drafts(tiny):
    params = SamplingParams(response_format=schema_format(FLAGS))
    target = TargetState(tiny, params, 0, capacity=64)
    assert TargetState(tiny, SamplingParams(), 0, capacity=8).grammar is None
    first, _ = target.prefill(tiny.tokenizer.encode("json:"))
    assert tiny.tokenizer.decode([first]) == "{"
    rest = target.grammar.matcher.forced_tokens()
    assert target.constrain(Proposal([*rest, BAD, *rest])).tokens == rest
    assert target.constrain(Proposal([BAD])).tokens == []


def test_plain_requests_are_untouched(tiny):
    params = SamplingParams(max_tokens=16)
    assert run(tiny, params, "ngram").tokens == run(tiny, params, source=NoDraftSource()).tokens


# --- the real default model -----------------------------------------------------------------------


def chat(model, text):
    return model.tokenizer.encode(model.tokenizer.render_chat([{"role": "user", "content": text}]))


REAL_CASES = {
    "person": ("Describe Ada Lovelace as JSON.", PERSON),
    "tool_call": ("What is the weather in Paris? Answer with a tool call.", TOOL_CALL),
    "json_object": ('Give me a JSON object with the keys "city" and "country" for Paris.', None),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_CASES))
def test_default_model_output_validates_and_is_the_same_with_every_drafter(served_model, name):
    text, schema = REAL_CASES[name]
    fmt = (
        {"type": "json_object"}
        if schema is None
        else {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
    )
    params = SamplingParams(max_tokens=64, response_format=canonical_response_format(fmt))
    prompt = chat(served_model, text)
    plain = decode(served_model, prompt, params, NoDraftSource(), k=0)
    assert plain.finish_reason == "stop"
    document = json.loads(plain.text)
    jsonschema.validate(document, schema or {"type": "object"})
    for drafter, k in (("ngram", None), ("suffix", 4), ("auto", None)):
        out = decode(served_model, prompt, params, make_draft_source(drafter, served_model), k=k)
        assert out.tokens == plain.tokens, drafter


# --- speclanes generate --response-format ---------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--response-format", "{nope"), "response_format is not valid JSON"),
        (("--response-format", '{"type": "yaml"}'), "response_format type must be one of"),
        (("--response-format", '{"type": "json_object"}', "--ignore-eos"), "drop ignore_eos"),
        (("--response-format", "@/nonexistent/format.json"), "format.json"),
    ],
)
def test_generate_refuses_a_bad_format_in_one_line(capsys, args, message):
    from pipeline.cli import main

    assert main(["generate", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("speclanes: error:") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_generate_with_a_schema_file(tmp_path, capsys):
    from pipeline.cli import main

    spec = {"type": "json_schema", "json_schema": {"name": "tool_call", "schema": TOOL_CALL}}
    (tmp_path / "format.json").write_text(json.dumps(spec))
    prompt = "What is the weather in Paris? Answer with a tool call."
    args = ["generate", prompt, "--chat", "--json", "--max-tokens", "64", "--response-format"]
    assert main([*args, f"@{tmp_path / 'format.json'}", "--drafter", "auto"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), TOOL_CALL)
