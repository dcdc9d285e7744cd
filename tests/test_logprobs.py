"""Log-probabilities (issue 15, item 2): the pure functions against textbook definitions; in-process
decoding with every drafter, chains and trees, greedy and seeded, against a plain one-token-at-a-time
forward of the numpy reference (to 1e-5, as the issue asks); the entries through the orchestrator's
core across a verify-lane restart and an orchestrator restart (exactly the in-process numbers); the
OpenAI shapes and refusals; `generate --json --logprobs`. The running gateway's tests are in
test_gateway.py (the real model)."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from openai.types.completion_choice import Logprobs

from pipeline import cli
from pipeline.api.chat import ChatFormatter
from pipeline.api.completions import TextFormatter
from pipeline.api.errors import ApiError
from pipeline.api.logprobs_format import LogprobsFormatter
from pipeline.audit.verify import verify_request
from pipeline.decoding.drafters import NoDraftSource, Proposal
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.grammar.compiler import compile_format
from pipeline.decoding.logprobs import TokenLogprobs, TopLogprob, likeliest, log_softmax, token_string
from pipeline.decoding.result import Result
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.decoding.target import TargetState
from pipeline.model import load_model
from pipeline.protocol.messages import Chunk, Open

from .api_surfaces import decode_request, to_submit
from .orchestration_harness import World
from .test_controls import reference_row, repetitive_prompt
from .test_grammar import SHORT, schema_format
from .tinymodel import TinySpec, write_tiny_gguf

TOLERANCE = 1e-5  # the issue's: the numpy reference computes a block's rows and a lone row apart

# --- the pure functions ---------------------------------------------------------------------------


def textbook_log_softmax(row: Sequence[float]) -> list[float]:
    finite = [x for x in row if x != -math.inf]
    top = max(finite)
    log_total = top + math.log(math.fsum(math.exp(x - top) for x in finite))
    return [x - log_total for x in row]


rows = st.lists(st.one_of(st.floats(-60, 60), st.just(-math.inf)), min_size=1, max_size=40).filter(
    lambda r: any(x != -math.inf for x in r)
)


@settings(max_examples=150, deadline=None)
@given(row=rows, n=st.integers(0, 45))
def test_log_softmax_and_the_likeliest_tokens_are_the_textbook_ones(row, n):
    got = log_softmax(np.array([row], np.float32))[0]
    want = textbook_log_softmax(np.array(row, np.float32).astype(float).tolist())
    assert np.allclose(got, want, rtol=0, atol=1e-12) and np.array_equal(np.isinf(got), np.isinf(want))
    best = likeliest(got, n)
    finite = [t for t in range(len(row)) if got[t] != -math.inf]
    assert best == sorted(finite, key=lambda t: (-got[t], t))[:n]  # ties by id; never a -inf token


def test_token_strings_are_text_or_escaped_bytes():
    assert token_string(" caf\xc3\xa9".encode("latin-1")) == " café"
    assert token_string(b"\xe2\x80") == "bytes:\\xe2\\x80"
    assert token_string(b"") == ""


# --- in-process decoding against a plain one-token-at-a-time forward -------------------------------


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The tiny target on the numpy float32 reference backend."""
    path = tmp_path_factory.mktemp("logprobs") / "target.gguf"
    write_tiny_gguf(path, TinySpec(seed=21, context=256))
    return load_model(path, "numpy")


def oracle(
    model, prompt: list[int], params: SamplingParams, tokens: list[int], mask=None
) -> list[list[float]]:
    """The log-softmax, in Python floats, of each output position's row from a forward fed one token at
    a time (no block, no speculation), shaped token by token (`reference_row`) and masked by `mask`
    (the grammar's allowed tokens after the output so far) if given."""
    cache = model.new_cache(capacity=len(prompt) + len(tokens) + 1)
    for token in prompt:
        last = model.forward(cache, [token])[-1]
    out = []
    for i, token in enumerate(tokens):
        row = reference_row(last, params, prompt, tokens[:i])
        if mask is not None:
            allowed = mask(tokens[:i])
            row = [x if allowed[t] else -math.inf for t, x in enumerate(row)]
        out.append(textbook_log_softmax(row))
        last = model.forward(cache, [token])[-1]
    return out


def assert_matches_oracle(model, prompt: list[int], params: SamplingParams, done: Result, mask=None) -> None:
    """Every served token has its entry, equal to the oracle's numbers at its position."""
    n, entries = params.logprobs, done.logprobs
    assert n is not None and entries is not None and [e.token for e in entries] == done.tokens
    tokenizer = model.tokenizer
    for entry, want in zip(entries, oracle(model, prompt, params, done.tokens, mask), strict=True):
        assert entry.piece == tokenizer.token_bytes(entry.token)
        assert abs(entry.logprob - want[entry.token]) <= TOLERANCE
        finite = sorted((x for x in want if x != -math.inf), reverse=True)
        assert len(entry.top) == min(n, len(finite))
        assert len({t.token for t in entry.top}) == len(entry.top)
        for top, value in zip(entry.top, finite, strict=False):
            assert abs(top.logprob - value) <= TOLERANCE and abs(top.logprob - want[top.token]) <= TOLERANCE
            assert top.piece == tokenizer.token_bytes(top.token)


CONTROLS = [{}, {"presence_penalty": 0.7, "repetition_penalty": 1.3, "logit_bias": {40: -100, 41: 3.0}}]


@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    drafter=st.sampled_from(["none", "ngram", "suffix", "auto"]), tree=st.booleans(),
    k=st.sampled_from([None, 1, 4]), temperature=st.sampled_from([0.0, 0.9]), seed=st.integers(0, 2**32),
    n=st.sampled_from([0, 1, 5, 20]), controls=st.sampled_from(CONTROLS), length=st.integers(3, 30),
)  # fmt: skip
def test_entries_are_the_target_s_log_softmax_at_each_emitted_position(
    reference, drafter, tree, k, temperature, seed, n, controls, length
):
    """Greedy or seeded, with every drafter, chains and trees: each entry is the log-softmax of the
    shaped logits (before temperature) a plain forward computes at its position, its top-n the
    likeliest of them; asking for them changes no token."""
    prompt = repetitive_prompt(seed % 1000, length)
    plain = SamplingParams(temperature=temperature, seed=seed, max_tokens=16, ignore_eos=True, **controls)
    source = make_draft_source(drafter, reference)
    without = decode(reference, prompt, plain, source, k=0 if drafter == "none" else k, tree=tree)
    asked = msgspec.structs.replace(plain, logprobs=n)
    source = make_draft_source(drafter, reference)
    done = decode(reference, prompt, asked, source, k=0 if drafter == "none" else k, tree=tree)
    assert done.tokens == without.tokens and without.logprobs is None
    assert_matches_oracle(reference, prompt, asked, done)


def test_the_values_are_before_temperature_and_speculation_is_exercised(reference):
    """The same greedy tokens at any temperature's entry: temperature is the sampler's, not the
    model's. The drafts really were verified and partly kept (the entries came from steps' rows)."""
    prompt = repetitive_prompt(4, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3)
    done = decode(reference, prompt, params, make_draft_source("ngram", reference), k=4)
    assert done.stats.accepted > 0 and done.stats.steps < len(done.tokens)
    assert_matches_oracle(reference, prompt, params, done)
    hot = msgspec.structs.replace(params, temperature=1.7, seed=5)
    sampled = decode(reference, prompt, hot, make_draft_source("ngram", reference), k=4)
    assert sampled.tokens != done.tokens  # the check below is not the greedy one again
    assert_matches_oracle(reference, prompt, hot, sampled)


def test_under_a_grammar_the_entries_are_of_the_masked_distribution(reference):
    """Tokens the grammar forbids have no probability: never listed, and the rest renormalised."""
    fmt = schema_format(SHORT)
    params = SamplingParams(max_tokens=120, logprobs=5, response_format=fmt)
    prompt = reference.tokenizer.encode("json:")
    done = decode(reference, prompt, params, make_draft_source("auto", reference))
    assert done.finish_reason == "stop" and json.loads(done.text)
    grammar = compile_format(reference.tokenizer, fmt, reference.cfg.vocab_size)

    def mask(so_far: list[int]) -> np.ndarray:
        matcher = grammar.matcher()
        for token in so_far:
            matcher.advance(token)
        return matcher.allowed_mask()

    assert_matches_oracle(reference, prompt, params, done, mask)
    assert any(len(e.top) < 5 for e in done.logprobs)  # positions where fewer than 5 tokens were allowed


# --- through the orchestrator's core: restarts, the journal, the audit -----------------------------


NATIVE_SPEC = TinySpec(seed=21, context=256, quant="Q8_0")  # the file's own blocks: no requantizing


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """The same tiny target on the row-invariant native backend: the pipeline's numbers are then
    bit for bit the in-process ones, whatever blocks and batches computed them."""
    path = tmp_path_factory.mktemp("logprobs-native") / "target.gguf"
    write_tiny_gguf(path, NATIVE_SPEC)
    return load_model(path, "native")


def test_a_stop_string_or_max_tokens_cuts_the_entries_with_the_tokens(native):
    """Exactly the uncut run's entries, as far as its tokens were served (the native backend: its
    numbers do not depend on the blocks, so `==`)."""
    prompt = repetitive_prompt(4, 24)
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    whole = decode(native, prompt, params, make_draft_source("ngram", native), k=8)
    stop = whole.text[len(whole.text) // 2 :][:2]
    stopped = msgspec.structs.replace(params, stop=(stop,))
    cut = decode(native, prompt, stopped, make_draft_source("ngram", native), k=8)
    assert cut.finish_reason == "stop" and len(cut.tokens) < len(whole.tokens)
    assert cut.logprobs == whole.logprobs[: len(cut.tokens)]
    short = decode(native, prompt, msgspec.structs.replace(params, max_tokens=5), NoDraftSource(), k=0)
    assert short.logprobs == whole.logprobs[:5]


def test_a_tree_s_entries_come_from_its_kept_path_s_rows(native):
    """A tree with a sibling before every node of plain decoding's continuation: each entry is its
    kept node's row (with that row's own history for the penalty), never the block's first rows."""
    prompt = repetitive_prompt(3, 12)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3, presence_penalty=0.5)
    plain = decode(native, prompt, params, NoDraftSource(), k=0)
    state = TargetState(native, params, 0, capacity=64)
    first, _ = state.prefill(prompt)
    assert state.logprobs == plain.logprobs[:1]
    tokens: list[int] = []
    parents: list[int] = []
    for token in plain.tokens[1:6]:
        above = len(tokens) - 1
        tokens += [4 if token == 3 else 3, token]  # a sibling first, then plain decoding's token
        parents += [above, above]
    verdict = state.step(first, Proposal(tokens, parents=parents))
    assert verdict.tokens == plain.tokens[1:7] and verdict.path == [1, 3, 5, 7, 9]
    assert state.logprobs == plain.logprobs[1:7]


SEEDED = SamplingParams(
    temperature=0.9, seed=77, presence_penalty=0.5, max_tokens=20, ignore_eos=True, logprobs=4
)


def streamed(chunks: list[Chunk]) -> list[TokenLogprobs]:
    assert all(len(c.logprobs) == len(c.tokens) for c in chunks)  # each chunk's entries are its tokens'
    return [e for c in chunks for e in c.logprobs]


def test_a_verify_lane_restart_streams_an_entry_for_every_token(native):
    """Killed mid-stream: the re-primed lane is asked the lost step again and answers it with its
    entries; the tokens streamed before the kill kept theirs. The audit passes as ever."""
    world = World.paced(native)  # a middle to kill the lane in
    world.up()
    prompt = repetitive_prompt(8, 15)
    request_id = world.submit(None, prompt_token_ids=prompt, params=SEEDED, drafter="ngram", k=4)
    world.run(until=14)
    before = list(world.hub.front.machine(request_id).chunks)
    assert before and streamed(before)
    world.down("verify")
    world.up("verify")
    world.run()
    assert any(isinstance(s.message, Open) and not s.message.sample for s in world.sent)  # re-primed
    machine = world.hub.front.machine(request_id)
    want = decode(native, prompt, SEEDED, NoDraftSource(), k=0)
    assert machine.result.tokens == want.tokens
    assert streamed(machine.chunks) == machine.result.logprobs == want.logprobs
    assert machine.chunks[: len(before)] == before
    events = [e for e in world.audited.values() if e.request_id == request_id]
    assert verify_request(request_id, events, native).verdict == "pass"


@pytest.mark.parametrize("deliver_in_flight", [False, True])
def test_an_orchestrator_restart_replays_the_entries_from_its_journal(native, tmp_path, deliver_in_flight):
    world = World(native, journal_path=str(tmp_path / "journal.db"))
    world.up()
    prompt = repetitive_prompt(9, 12)
    request_id = world.submit(None, prompt_token_ids=prompt, params=SEEDED, drafter="suffix")
    world.run(until=12)
    seen = list(world.hub.front.machine(request_id).chunks)
    world.orchestrator_killed(deliver_in_flight)
    replayed = world.hub.front.machine(request_id).chunks
    assert replayed[: len(seen)] == seen  # what a client saw comes back with its entries
    world.run()
    machine = world.hub.front.machine(request_id)
    want = decode(native, prompt, SEEDED, NoDraftSource(), k=0)
    assert machine.result.tokens == want.tokens
    assert streamed(machine.chunks) == machine.result.logprobs == want.logprobs


def test_without_logprobs_nothing_is_computed_or_carried(native):
    world = World(native)
    world.up()
    prompt = repetitive_prompt(8, 15)
    request_id = world.submit(None, prompt_token_ids=prompt, params=SamplingParams(max_tokens=12))
    world.run()
    machine = world.hub.front.machine(request_id)
    assert machine.result.logprobs is None and all(c.logprobs == [] for c in machine.chunks)


# --- the OpenAI shapes and refusals ----------------------------------------------------------------


MODEL = "m"


def params_of(is_chat: bool, **fields) -> SamplingParams:
    prompt = {"messages": [{"role": "user", "content": "hi"}]} if is_chat else {"prompt": "x"}
    body = {"model": MODEL, **fields, **prompt}
    return to_submit(decode_request(json.dumps(body).encode(), is_chat), MODEL).params


@pytest.mark.parametrize(
    ("is_chat", "fields", "expected"),
    [
        (True, {"logprobs": True}, 0), (True, {"logprobs": True, "top_logprobs": 20}, 20),
        (True, {"logprobs": False}, None), (True, {"logprobs": False, "top_logprobs": 0}, None),
        (True, {}, None),
        (False, {"logprobs": 0}, 0), (False, {"logprobs": 5}, 5), (False, {"logprobs": 20}, 20),
        (False, {"logprobs": None}, None), (False, {"logprobs": False}, None),
    ],
)  # fmt: skip
def test_what_a_request_asks_for(is_chat, fields, expected):
    assert params_of(is_chat, **fields).logprobs == expected


@pytest.mark.parametrize(
    ("is_chat", "fields", "param"),
    [
        (True, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        (True, {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        (True, {"top_logprobs": 3}, "top_logprobs"),  # without logprobs: true
        (True, {"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        (True, {"logprobs": 5}, "logprobs"),  # chat's logprobs is a boolean
        (True, {"logprobs": "yes"}, "logprobs"),
        (False, {"logprobs": 21}, "logprobs"), (False, {"logprobs": -1}, "logprobs"),
        (False, {"logprobs": True}, "logprobs"), (False, {"logprobs": 2, "top_logprobs": 2}, "top_logprobs"),
    ],
)  # fmt: skip
def test_bad_values_are_400s_naming_the_field(is_chat, fields, param):
    with pytest.raises(ApiError) as caught:
        params_of(is_chat, **fields)
    assert caught.value.status == 400 and caught.value.param == param, caught.value.message


def entry(token: int, piece: bytes, logprob: float, *top: tuple[int, bytes, float]) -> TokenLogprobs:
    return TokenLogprobs(token, piece, logprob, [TopLogprob(*t) for t in top])


ENTRIES = [
    entry(5, b"Hi", -0.25, (5, b"Hi", -0.25), (9, b"Hey", -1.5)),
    entry(7, b"\xe2\x80", -0.5, (7, b"\xe2\x80", -0.5), (8, b" ", -2.0)),  # half of a character
    entry(6, b"\x94!", -0.75, (3, b"?", -0.5), (6, b"\x94!", -0.75)),  # its end: "—!"
]


def test_chat_shapes_parse_as_the_openai_client_s_models():
    fmt = ChatFormatter("r1", MODEL, 1, 3, logprobs=True)
    chunk = ChatCompletionChunk.model_validate(fmt.text("Hi", ENTRIES[:1]))
    content = chunk.choices[0].logprobs.content
    assert [(c.token, c.logprob, c.bytes) for c in content] == [("Hi", -0.25, list(b"Hi"))]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [("Hi", -0.25), ("Hey", -1.5)]
    done = Result(finish_reason="length", tokens=[5, 7, 6], text="Hi—!", logprobs=ENTRIES)
    whole = ChatCompletion.model_validate(fmt.response(done))
    tokens = whole.choices[0].logprobs.content
    assert [t.token for t in tokens] == ["Hi", "bytes:\\xe2\\x80", "bytes:\\x94\\x21"]
    assert bytes(b for t in tokens for b in t.bytes).decode() == done.text  # the bytes are exact
    assert ChatFormatter("r1", MODEL, 1, 3).response(done)["choices"][0]["logprobs"] is None  # not asked


def test_completion_shapes_count_text_offsets_across_a_stream():
    fmt = TextFormatter("r1", MODEL, 1, 3, logprobs=True)
    # Mid-stream chunks have finish_reason null, which the client's Completion model does not allow.
    first = Logprobs.model_validate(fmt.text("Hi", ENTRIES[:2])["choices"][0]["logprobs"])
    second = Logprobs.model_validate(fmt.text("—!", ENTRIES[2:])["choices"][0]["logprobs"])
    assert first.tokens == ["Hi", "bytes:\\xe2\\x80"] and first.token_logprobs == [-0.25, -0.5]
    assert first.text_offset == [0, 2] and second.text_offset == [2]  # the split character starts at 2
    # The likeliest tokens and the chosen one ("up to logprobs + 1", as OpenAI documents).
    assert second.top_logprobs == [{"?": -0.5, "bytes:\\x94\\x21": -0.75}]
    done = Result(finish_reason="length", tokens=[5, 7, 6], text="Hi—!", logprobs=ENTRIES)
    whole = Completion.model_validate(TextFormatter("r1", MODEL, 1, 3, logprobs=True).response(done))
    assert whole.choices[0].logprobs.text_offset == [0, 2, 2]
    assert LogprobsFormatter(False).format([])["tokens"] == []


# --- the CLI -------------------------------------------------------------------------------------


def test_generate_json_carries_the_entries_as_objects(native, tmp_path, capsys):
    """The in-process numbers, as objects (the default drafter on the row-invariant backend: `==`)."""
    path = tmp_path / "target.gguf"
    write_tiny_gguf(path, NATIVE_SPEC)
    argv = ["generate", "the the", "-m", str(path), "--backend", "native", "--max-tokens", "6", "--json"]
    assert cli.main([*argv, "--logprobs", "2"]) == 0
    printed = json.loads(capsys.readouterr().out)
    prompt = native.tokenizer.encode("the the")
    params = SamplingParams(max_tokens=6, logprobs=2)
    want = decode(native, prompt, params, make_draft_source("auto", native))
    assert printed["tokens"] == want.tokens

    def one(token: int, piece: bytes, logprob: float) -> dict:
        return {"token": token, "text": token_string(piece), "logprob": logprob}

    entries = want.logprobs
    tops = [[one(t.token, t.piece, t.logprob) for t in e.top] for e in entries]
    expected = [
        one(e.token, e.piece, e.logprob) | {"top_logprobs": top} for e, top in zip(entries, tops, strict=True)
    ]
    assert printed["logprobs"] == expected
    assert cli.main([*argv[:-1], "--logprobs", "2"]) == 2  # without --json: nowhere to show them
    assert "add --json" in capsys.readouterr().err
    assert cli.main([*argv, "--logprobs", "21"]) == 2
    assert "logprobs must be in [0, 20]" in capsys.readouterr().err
