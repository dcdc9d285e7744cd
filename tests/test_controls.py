"""The sampling controls (logit_bias, presence/frequency/repetition penalties, min_p), exact under
speculation. Property tests of the pure functions against a token-by-token reference; then whole
requests on tiny models (the native backend: row-invariant, so greedy equality holds by
construction): greedy output is plain greedy decoding's with every drafter, seeded output is plain
seeded decoding's with every deterministic drafter, through the orchestrator's core with a verify
lane restart in the middle, and `audit verify` passes on what was recorded. Every comparison is
exact (`==`, `np.array_equal`)."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline import cli
from pipeline.audit.verify import verify_request
from pipeline.decoding.controls import chain_paths, row_paths, shaped_logits, shaped_probs, vocabulary_problem
from pipeline.decoding.drafters import NoDraftSource, Proposal
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.drafters.ngram import NgramSource
from pipeline.decoding.drafters.registry import make_draft_source
from pipeline.decoding.drafters.suffix import SuffixSource
from pipeline.decoding.sampling import SamplingParams, sample_at, target_probs
from pipeline.decoding.speculative import decode
from pipeline.decoding.target import TargetState
from pipeline.model import load_model
from pipeline.protocol.messages import DraftRequest, ErrorReply, Open, StepFailed, Submit

from .orchestration_harness import World
from .test_audit import audited_run
from .tinymodel import TinySpec, write_tiny_gguf

# --- the pure functions ----------------------------------------------------------------


def reference_row(
    row: np.ndarray, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]
) -> list[float]:
    """One row shaped token by token, in Python floats, as vLLM describes it: the bias (-100 bans),
    then the repetition penalty over prompt and output, then frequency and presence over the output."""
    out = [float(x) for x in row]
    for token, bias in params.logit_bias:
        out[token] = -math.inf if bias == -100 else out[token] + bias
    counts, seen = Counter(generated), {*prompt, *generated}
    for token, value in enumerate(out):
        if token in seen:
            value = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
        if counts[token]:
            value = value - params.frequency_penalty * counts[token] - params.presence_penalty
        out[token] = value
    return out


@st.composite
def shaping_cases(draw, greedy: bool | None = None):
    """Logits rows, controls, a context with its prompt length, and one path per row."""
    vocab, n = draw(st.integers(2, 24)), draw(st.integers(1, 5))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    logits = (rng.standard_normal((n, vocab)) * draw(st.sampled_from([0.5, 3.0, 20.0]))).astype(np.float32)
    logits[rng.random((n, vocab)) < 0.1] = 0.0  # zeros sit between the two sides of the repetition rule
    tokens = st.integers(0, vocab - 1)
    bias = st.dictionaries(tokens, st.floats(-100, 100) | st.just(-100.0), max_size=vocab - 1)
    temperatures = [0.0] if greedy else [0.5, 1.0, 1.9] if greedy is False else [0.0, 0.5, 1.0, 1.9]
    params = SamplingParams(
        temperature=draw(st.sampled_from(temperatures)),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.5, 1.0])),
        presence_penalty=draw(st.floats(-2, 2)),
        frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.sampled_from([1.0, 0.5, 1.3, 2.0]) | st.floats(0.01, 5)),
        logit_bias=draw(bias),
    )
    context = draw(st.lists(tokens, min_size=1, max_size=30))
    prompt_length = draw(st.integers(1, len(context)))
    paths = draw(st.lists(st.lists(tokens, max_size=5), min_size=n, max_size=n))
    return logits, params, context, prompt_length, paths


@settings(max_examples=200, deadline=None)
@given(case=shaping_cases())
def test_shaping_is_the_token_by_token_definition(case):
    logits, params, context, prompt_length, paths = case
    shaped = shaped_logits(logits, params, context, prompt_length, paths)
    prompt, generated = context[:prompt_length], context[prompt_length:]
    rows = zip(logits, paths, strict=True)
    expected = [reference_row(row, params, prompt, [*generated, *path]) for row, path in rows]
    assert np.array_equal(shaped, np.array(expected))


@settings(max_examples=200, deadline=None)
@given(case=shaping_cases())
def test_penalties_touch_only_tokens_in_the_row_s_history(case):
    logits, params, context, prompt_length, paths = case
    params = msgspec.structs.replace(params, logit_bias=())
    shaped = shaped_logits(logits, params, context, prompt_length, paths)
    for row, before, path in zip(shaped, logits, paths, strict=True):
        untouched = np.ones(len(row), dtype=bool)
        untouched[[*context, *path]] = False
        assert np.array_equal(row[untouched], before[untouched].astype(np.float64))


@settings(max_examples=200, deadline=None)
@given(case=shaping_cases(), data=st.data())
def test_rows_give_the_same_numbers_in_any_grouping(case, data):
    """A row shaped alone (its path folded into the context) or with any others, and a block split
    at any point into base context and per-row paths: bit for bit the same row."""
    logits, params, context, prompt_length, paths = case
    whole = shaped_probs(logits, params, context, prompt_length, paths)
    for i, path in enumerate(paths):
        alone = shaped_probs(logits[i : i + 1], params, [*context, *path], prompt_length, [[]])
        assert np.array_equal(alone[0], whole[i])
    split = data.draw(st.integers(0, min(len(p) for p in paths)))  # the rows' common prefix may
    shared = paths[0][:split]  # move into the base context when every path starts with it
    if all(p[:split] == shared for p in paths):
        moved = shaped_probs(logits, params, [*context, *shared], prompt_length, [p[split:] for p in paths])
        assert np.array_equal(moved, whole)
    order = data.draw(st.permutations(range(len(paths))))
    shuffled = shaped_probs(logits[order], params, context, prompt_length, [paths[i] for i in order])
    assert np.array_equal(shuffled, whole[order])


@settings(max_examples=200, deadline=None)
@given(case=shaping_cases(), top_k=st.sampled_from([0, 1, 3]), top_p=st.sampled_from([1.0, 0.9, 0.3]))
def test_a_bias_of_minus_100_removes_the_token_from_every_distribution(case, top_k, top_p):
    logits, params, context, prompt_length, paths = case
    banned = [t for t, bias in params.logit_bias if bias == -100]
    params = msgspec.structs.replace(params, top_k=top_k, top_p=top_p)
    probs = shaped_probs(logits, params, context, prompt_length, paths)
    assert np.all(probs[:, banned] == 0.0)
    assert np.all(np.isfinite(probs)) and np.all(probs.max(axis=1) > 0)  # some token is left to draw


@settings(max_examples=200, deadline=None)
@given(case=shaping_cases(greedy=False))
def test_min_p_keeps_the_most_likely_token_and_drops_exactly_the_unlikely_ones(case):
    logits, params, *_ = case
    probs = target_probs(logits, params)
    scaled = logits.astype(np.float64) / params.temperature
    ratio = np.exp(scaled - scaled.max(axis=1, keepdims=True))
    assert np.all(probs[np.arange(len(probs)), logits.argmax(axis=1)] > 0)
    assert np.array_equal(probs > 0, ratio >= params.min_p)


def test_without_controls_the_logits_are_not_touched_or_copied():
    logits = np.arange(12, dtype=np.float32).reshape(2, 6)
    assert shaped_logits(logits, SamplingParams(temperature=0.7, min_p=0.2), [1, 2], 1, [[], [3]]) is logits


def test_a_greedy_choice_follows_the_shaped_logits():
    logits = np.array([[0.0, 5.0, 4.0, -1.0]], np.float32)
    assert shaped_probs(logits, SamplingParams(), [0], 1, [[]]).argmax() == 1
    banned = SamplingParams(logit_bias={1: -100})
    assert shaped_probs(logits, banned, [0], 1, [[]]).argmax() == 2
    # 5 / 2 = 2.5 < 4: a repetition penalty of 2 on token 1 (seen in the prompt) hands the choice to 2
    assert shaped_probs(logits, SamplingParams(repetition_penalty=2.0), [1], 1, [[]]).argmax() == 2
    # presence counts the output only: token 1 in the prompt is not penalised, in the path it is
    presence = SamplingParams(presence_penalty=1.5)
    assert shaped_probs(logits, presence, [1], 1, [[]]).argmax() == 1
    assert shaped_probs(logits, presence, [0], 1, [[1]]).argmax() == 2


def test_chain_paths_are_the_drafts_before_each_row():
    assert chain_paths([7, 8, 9]) == [[], [7], [7, 8], [7, 8, 9]]
    assert chain_paths([]) == [[]]
    assert row_paths([7, 8, 9], None) == chain_paths([7, 8, 9]) == row_paths([7, 8, 9], [-1, 0, 1])


def test_a_tree_row_has_seen_the_path_from_the_root_to_its_node():
    """[pending, a, b, c, d] with a and c under pending, b under a, d under b: row 4 (node d) has
    seen a, b, d and not c."""
    assert row_paths([10, 11, 12, 13], [-1, 0, -1, 1]) == [[], [10], [10, 11], [12], [10, 11, 13]]


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"min_p": -0.1}, "min_p must be in [0, 1]"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"presence_penalty": 2.01}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"frequency_penalty": math.nan}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be a finite number > 0"),
        ({"repetition_penalty": math.inf}, "repetition_penalty must be a finite number > 0"),
        ({"logit_bias": {5: 100.5}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {5: math.nan}}, "logit_bias values must be in [-100, 100]"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias token ids must be in [0, 2**31)"),
        ({"logit_bias": {2**70: 1.0}}, "logit_bias token ids must be in [0, 2**31)"),
    ],
)
def test_out_of_range_controls_are_refused_naming_the_setting(fields, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        SamplingParams(**fields)


def test_the_edges_of_each_range_are_accepted():
    SamplingParams(min_p=1.0, presence_penalty=-2, frequency_penalty=2, repetition_penalty=1e-3)
    SamplingParams(logit_bias={0: -100, 1: 100})


def test_a_bias_is_kept_as_sorted_pairs_so_the_params_stay_hashable_and_travel():
    """Requests are cached and compared by their params; a dict would make them unhashable."""
    params = SamplingParams(logit_bias={9: 1, 5: -100})
    assert (
        params.logit_bias
        == ((5, -100.0), (9, 1.0))
        == SamplingParams(logit_bias=[(9, 1), (5, -100)]).logit_bias
    )
    assert hash(params) == hash(SamplingParams(logit_bias={5: -100, 9: 1.0}))
    for codec in (msgspec.msgpack, msgspec.json):
        assert codec.decode(codec.encode(params), type=SamplingParams) == params
    with pytest.raises(ValueError, match="names a token id twice"):
        SamplingParams(logit_bias=[(1, 2.0), (1, 3.0)])


def test_the_vocabulary_bounds_the_bias():
    assert vocabulary_problem(SamplingParams(logit_bias={9: 1.0}), 10) is None
    outside = vocabulary_problem(SamplingParams(logit_bias={10: 1}), 10)
    assert outside is not None and "outside the model's vocabulary" in outside
    every = SamplingParams(logit_bias=dict.fromkeys(range(10), -100.0))
    assert "bans every token" in (vocabulary_problem(every, 10) or "")


def test_cli_flags_become_the_controls_and_bad_ones_end_in_one_error_line(capsys):
    args = cli.build_parser(with_benches=False).parse_args([
        "generate", "x", "--min-p", "0.1", "--presence-penalty", "0.5", "--frequency-penalty", "-0.5",
        "--repetition-penalty", "1.2", "--logit-bias", "7=-100", "--logit-bias", "9=2.5",
    ])  # fmt: skip
    params = cli._sampling(args)
    assert (params.min_p, params.presence_penalty, params.frequency_penalty) == (0.1, 0.5, -0.5)
    assert params.repetition_penalty == 1.2 and params.logit_bias == ((7, -100.0), (9, 2.5))
    for bad, words in (("--logit-bias=7", "TOKEN=BIAS"), ("--min-p=2", "min_p must be in [0, 1]")):
        assert cli.main(["generate", "x", bad]) == 2  # refused before any model is loaded
        assert words in capsys.readouterr().err


# --- whole requests on tiny models -----------------------------------------------------

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target and a draft with the same vocabulary, on the row-invariant native backend."""
    root = tmp_path_factory.mktemp("controls")
    write_tiny_gguf(root / "target.gguf", TinySpec(seed=21, scale=1.2, quant="Q4_1"))
    write_tiny_gguf(root / "draft.gguf", TinySpec(seed=21, scale=0.8, quant="Q4_1"))
    return load_model(root / "target.gguf", "native"), load_model(root / "draft.gguf", "native")


def sources(target, draft):
    return {
        "ngram": NgramSource(), "suffix": SuffixSource(), "auto": make_draft_source("auto", target, draft),
        "model": ModelSource(draft, target), "self-model": ModelSource(target, target),
    }  # fmt: skip


# Negative penalties and a repetition penalty under 1 encourage repeats: n-gram drafters then find
# drafts to verify; positive ones make the drafts' own tokens count against them, row by row.
controls = st.fixed_dictionaries({
    "presence_penalty": st.sampled_from([0.0, 0.4, -0.8, 2.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.3, -0.5, -2.0]),
    "repetition_penalty": st.sampled_from([1.0, 1.3, 0.6]),
    "min_p": st.sampled_from([0.0, 0.05, 0.3]),
    "logit_bias": st.dictionaries(st.integers(3, 266), st.sampled_from([-100.0, -4.0, 3.0, 8.0]), max_size=4),
})  # fmt: skip


def repetitive_prompt(seed: int, length: int) -> list[int]:
    base = np.random.default_rng(seed).integers(3, 267, size=max(2, length // 3)).tolist()
    return (base * 4)[:length]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chosen=controls, seed=st.integers(0, 10_000), length=st.integers(2, 40),
    k=st.sampled_from([None, 1, 3, 8]), tree=st.booleans(),
    drafter=st.sampled_from(["ngram", "suffix", "auto", "model", "self-model"]),
)  # fmt: skip
def test_greedy_output_with_controls_is_plain_greedy_decoding_s(
    models, chosen, seed, length, k, tree, drafter
):
    """Chains and token trees (the n-gram drafters' candidates merged; row i conditions on its own
    root-to-node path)."""
    target, draft = models
    prompt, params = repetitive_prompt(seed, length), SamplingParams(**chosen, max_tokens=24, ignore_eos=True)
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    spec = decode(target, prompt, params, sources(target, draft)[drafter], k=k, tree=tree)
    assert spec.tokens == plain.tokens


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chosen=controls, seed=st.integers(0, 2**64 - 1), length=st.integers(2, 40),
    k=st.sampled_from([None, 1, 3, 8]), temperature=st.sampled_from([0.5, 1.0, 1.6]),
    top_k=st.sampled_from([0, 20]), top_p=st.sampled_from([1.0, 0.8]), tree=st.booleans(),
    drafter=st.sampled_from(["ngram", "suffix", "auto"]),
)  # fmt: skip
def test_seeded_output_with_controls_is_plain_seeded_decoding_s(
    models, chosen, seed, length, k, temperature, top_k, top_p, tree, drafter
):
    target, _ = models
    params = SamplingParams(
        **chosen, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=24, ignore_eos=True
    )
    prompt = repetitive_prompt(seed % 10_000, length)
    source = {"ngram": NgramSource(), "suffix": SuffixSource(), "auto": make_draft_source("auto", target)}
    plain = decode(target, prompt, params, NoDraftSource(), k=0)
    assert decode(target, prompt, params, source[drafter], k=k, tree=tree).tokens == plain.tokens


def oracle(model, prompt: list[int], params: SamplingParams, seed: int, n: int) -> list[int]:
    """Decoding with no cache and no speculation: each position from a whole forward over its
    context, shaped token by token (`reference_row`), drawn with the position's own number."""
    context = list(prompt)
    for _ in range(n):
        last = model.forward(model.new_cache(capacity=len(context)), context)[-1]
        row = np.array(reference_row(last, params, prompt, context[len(prompt) :]))
        token, _ = sample_at(target_probs(row, params), seed, len(context))
        context.append(token)
    return context[len(prompt) :]


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_decoding_with_controls_is_the_token_by_token_oracle(models, temperature):
    """The equality tests above would also pass if every path ignored the controls alike."""
    target, _ = models
    prompt = repetitive_prompt(3, 18)
    params = SamplingParams(
        temperature=temperature, seed=11, min_p=0.02, presence_penalty=0.7, frequency_penalty=0.4,
        repetition_penalty=1.4, logit_bias={40: -100, 41: 2.0, 99: 5.0}, max_tokens=20, ignore_eos=True,
    )  # fmt: skip
    done = decode(target, prompt, params, NgramSource(), k=4)
    assert done.tokens == oracle(target, prompt, params, 11, 20)
    neutral = SamplingParams(temperature=temperature, seed=11, min_p=0.02, max_tokens=20, ignore_eos=True)
    assert done.tokens != decode(target, prompt, neutral, NoDraftSource(), k=0).tokens


def test_speculation_is_exercised_under_controls(models):
    """Drafts are verified, kept and rejected with the controls on; the target drafting for itself
    is kept every time, so the model drafter's rows are shaped exactly as the verifier's."""
    target, _ = models
    params = SamplingParams(
        presence_penalty=-0.8, frequency_penalty=0.3, logit_bias={50: 8.0}, max_tokens=40, ignore_eos=True
    )
    prompt = repetitive_prompt(5, 24)
    ngram = decode(target, prompt, params, NgramSource(), k=4).stats
    assert 0 < ngram.accepted < ngram.drafted
    strong = msgspec.structs.replace(params, presence_penalty=2.0, repetition_penalty=1.5)
    itself = decode(target, prompt, strong, ModelSource(target, target), k=4).stats
    assert itself.drafted > 0 and itself.acceptance_rate == 1.0


# --- the verify lane, re-primed; the audit trail ---------------------------------------

SEEDED = SamplingParams(
    temperature=0.9, seed=77, presence_penalty=1.2, frequency_penalty=0.6, repetition_penalty=1.3,
    min_p=0.01, logit_bias={66: 4.0, 67: -100}, max_tokens=24, ignore_eos=True,
)  # fmt: skip


def test_a_verify_lane_restart_keeps_the_penalties_and_the_audit_passes(models):
    """The re-primed lane is told where the prompt ends in the prefix it feeds: presence and
    frequency keep counting the output only, and the output is the in-process one."""
    target, _ = models
    world = World(target)
    world.up()
    prompt = repetitive_prompt(8, 15)
    request_id = world.submit(None, prompt_token_ids=prompt, params=SEEDED, drafter="ngram", k=4)
    world.run(until=14)
    world.down("verify")
    world.up("verify")
    world.run()
    result = world.result(request_id)
    assert result is not None and result.tokens == decode(target, prompt, SEEDED, NoDraftSource(), k=0).tokens
    (reprime,) = [s.message for s in world.sent if isinstance(s.message, Open) and not s.message.sample]
    assert reprime.prompt_length == len(prompt) < len(reprime.tokens)
    events = [e for e in world.audited.values() if e.request_id == request_id]
    assert verify_request(request_id, events, target).verdict == "pass"


def test_admission_checks_token_prompts_and_the_bias_against_the_vocabulary(models):
    target, _ = models
    world = World(target)
    vocab = target.cfg.vocab_size
    banned = dict.fromkeys(range(vocab), -100.0)
    refused = {
        "prompt_token_ids": Submit(prompt_token_ids=[5, vocab]),
        "text and ids": Submit(prompt="ab", prompt_token_ids=[5]),
        "empty ids": Submit(prompt_token_ids=[]),
        "bias outside": Submit(prompt="ab", params=SamplingParams(logit_bias={vocab: 1.0})),
        "every token banned": Submit(prompt="ab", params=SamplingParams(logit_bias=banned)),
    }  # fmt: skip
    words = ["outside the vocabulary", "not several", "empty", "outside the model's vocabulary", "bans every"]
    for (name, submit), expected in zip(refused.items(), words, strict=True):
        reply, sends = world.hub.submit(submit, world.now)
        assert isinstance(reply, ErrorReply) and reply.kind == "bad_request", name
        assert expected in reply.message, (name, reply.message)
        assert sends == []
    # The lanes check what reaches them directly too: a bad request costs it a step, never the lane.
    reprime = Open(request_id="r", step=0, tokens=[5, 6], params=GREEDY, seed=1, prompt_length=3)
    verifier_reply = world.verifier.open(reprime)
    assert verifier_reply is not None and "prompt length 3 for 2 tokens" in verifier_reply.message
    outside = SamplingParams(logit_bias={vocab: 1.0})
    draft = DraftRequest(
        request_id="r", step=1, drafter="ngram", params=outside, seed=1, prompt_length=2, context=[5, 6], k=2
    )
    draft_reply = world.drafter_server("ngram").draft(draft)
    assert isinstance(draft_reply, StepFailed) and "outside the model's vocabulary" in draft_reply.message


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_audit_verify_recomputes_the_controls(models, drafter):
    """A sampled request with the model drafter (its p rows shaped too) passes; the same record
    read as if the request had no controls fails: the check really applies them."""
    target, draft = models
    params = msgspec.structs.replace(SEEDED, max_tokens=32)
    src = ModelSource(draft, target) if drafter == "model" else NgramSource()
    events = audited_run(target, params, src, k=3)
    assert verify_request("req", events, target, draft).verdict == "pass"
    plain = msgspec.to_builtins(msgspec.structs.replace(params, presence_penalty=0.0, frequency_penalty=0.0))
    opened = msgspec.structs.replace(events[0], settings={**events[0].settings, "params": plain})
    assert verify_request("req", [opened, *events[1:]], target, draft).verdict == "fail"


# --- token trees: each row conditions on its own root-to-node path ----------------------


tree_controls = st.fixed_dictionaries({
    "presence_penalty": st.sampled_from([0.0, 0.7, -0.7, 2.0]),
    "frequency_penalty": st.sampled_from([0.0, 0.5, -1.0]),
    "repetition_penalty": st.sampled_from([1.0, 1.5, 0.7]),
    "logit_bias": st.dictionaries(st.integers(3, 11), st.sampled_from([-100.0, -2.0, 2.0]), max_size=2),
})  # fmt: skip


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    chosen=tree_controls, seed=st.integers(0, 2**64 - 1), temperature=st.sampled_from([0.0, 0.8]),
    depth=st.integers(1, 6), distractors=st.lists(st.integers(3, 266), min_size=6, max_size=6),
)  # fmt: skip
def test_a_tree_block_decides_each_node_on_its_own_path(
    models, chosen, seed, temperature, depth, distractors
):
    """A tree holding plain decoding's continuation with a sibling before every node of it: the
    verifier keeps the whole path, so each row saw its own root-to-node tokens, never the siblings
    that precede it in the block; and the step after it sees the kept path."""
    target, _ = models
    prompt = repetitive_prompt(seed % 10_000, 12)
    params = SamplingParams(
        **chosen, temperature=temperature, seed=seed, max_tokens=depth + 3, ignore_eos=True
    )
    plain = decode(target, prompt, params, NoDraftSource(), k=0).tokens
    state = TargetState(target, params, seed, capacity=64)
    assert state.prefill(prompt)[0] == plain[0]
    tokens: list[int] = []
    parents: list[int] = []
    above = -1
    for d in range(depth):
        if distractors[d] != plain[d + 1]:
            tokens.append(distractors[d])
            parents.append(above)
        tokens.append(plain[d + 1])
        parents.append(above)
        above = len(tokens) - 1
    verdict = state.step(plain[0], Proposal(tokens, parents=parents))
    assert verdict.tokens == plain[1 : depth + 2]
    # The kept path, not the block's first nodes, is what the next step's rows have seen.
    assert state.step(verdict.tokens[-1], Proposal([])).tokens == [plain[depth + 2]]
