"""Structured output through the pipeline's cores (issue 15): the orchestrator's `Hub`, a real verify
lane core and draft lane core on a tiny model (`orchestration_harness.World`: every message through
its msgspec encoding), lane restarts, admission, and `audit verify` applying the grammar.

The tiny model's weights are random: whatever JSON it emits is the grammar's doing, and every output
is compared with in-process plain decoding (`--drafter none`) token for token. The real default model,
the HTTP gateway and a SIGKILLed verify lane are in test_gateway.py and test_pipeline.py (slow)."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from pipeline.audit.verify import verify_request
from pipeline.decoding.drafters import EMPTY, NoDraftSource
from pipeline.decoding.drafters.model import ModelSource
from pipeline.decoding.sampling import SamplingParams
from pipeline.decoding.speculative import decode
from pipeline.model import Model
from pipeline.orchestration.admission import MAX_FORMAT_CHARS
from pipeline.protocol.messages import ErrorReply, Open, StepEvent, Submit, Verify

from .orchestration_harness import World
from .test_audit import audited_run
from .test_grammar import BAD, FLAGS, SHORT, TINY_SCHEMAS, OracleSource, schema_format
from .tinymodel import TinySpec, write_tiny_gguf

PROMPT_TEXT = "Answer in JSON: the answer is"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A target and a draft model with one vocabulary (they disagree on probabilities)."""
    root = tmp_path_factory.mktemp("structured")
    write_tiny_gguf(root / "target.gguf", TinySpec(seed=21, scale=1.2, context=256))
    write_tiny_gguf(root / "draft.gguf", TinySpec(seed=21, scale=0.8, context=256))
    return Model.load(root / "target.gguf"), Model.load(root / "draft.gguf")


def prompt_of(model: Model) -> list[int]:
    return model.tokenizer.encode(PROMPT_TEXT)


def plain(model: Model, params: SamplingParams) -> list[int]:
    return decode(model, prompt_of(model), params, NoDraftSource(), k=0).tokens


def served(world: World, params: SamplingParams, drafter: str, k: int | None = None, **run: int) -> str:
    request_id = world.submit(
        None, prompt_token_ids=prompt_of(world.model), params=params, drafter=drafter, k=k
    )
    world.run(**run)
    return request_id


def audited(world: World, request_id: str) -> list:
    return [e for e in world.audited.values() if e.request_id == request_id]


GREEDY = {
    name: SamplingParams(max_tokens=120, response_format=schema_format(s)) for name, s in TINY_SCHEMAS.items()
}
SEEDED = SamplingParams(
    max_tokens=120, temperature=0.9, top_k=20, seed=11, response_format=schema_format(SHORT)
)


@pytest.mark.parametrize("case", [*GREEDY, "seeded"])
def test_pipeline_output_is_plain_constrained_decoding_with_every_drafter(models, case):
    """Greedy (three schemas) and seeded sampling: the pipeline with each deterministic drafter serves
    exactly in-process plain decoding's tokens, the JSON validates, and the audit trail passes."""
    target, _ = models
    params = SEEDED if case == "seeded" else GREEDY[case]
    schema = SHORT if case == "seeded" else TINY_SCHEMAS[case]
    want = plain(target, params)
    world = World(target)
    world.up()
    drafted = 0
    for drafter, k in (("none", None), ("ngram", 4), ("suffix", None), ("auto", None)):
        request_id = served(world, params, drafter, k)
        result = world.result(request_id)
        assert result is not None and result.error is None, drafter
        assert result.tokens == want and result.finish_reason == "stop", drafter
        jsonschema.validate(json.loads(result.text), schema)
        assert verify_request(request_id, audited(world, request_id), target).verdict == "pass", drafter
        drafted += result.stats.drafted
    assert drafted > 0  # speculation ran: the grammar's forced tokens at least are drafted for free


def test_forbidden_drafts_are_cut_by_the_verify_lane_and_never_booked(models):
    """A drafter proposing forbidden tokens (a chain with one inside, a tree with a forbidden sibling
    that has a child): the lane cuts them before the forward and says which nodes it ran, so the stats,
    the controller and the audit trail count only those."""
    target, _ = models
    params = GREEDY["flags"]
    want = plain(target, params)
    for tree in (False, True):
        world = World(target)
        world.up()
        world.hub.config = msgspec.structs.replace(
            world.hub.config, speculation=msgspec.structs.replace(world.hub.config.speculation, tree=tree)
        )
        oracle = OracleSource(len(prompt_of(target)), want)
        world.drafter_server("ngram").sources["ngram"] = oracle
        request_id = served(world, params, "ngram", 4)
        result = world.result(request_id)
        assert result is not None and result.tokens == want, tree
        sent = [m for m in world.to_verifier if isinstance(m, Verify)]
        assert oracle.with_bad > 0 and any(BAD in msg.drafts for msg in sent), tree  # the lane saw them
        steps = [e for e in audited(world, request_id) if isinstance(e, StepEvent)]
        assert all(BAD not in step.drafted for step in steps), tree
        assert (
            sum(len(step.drafted) for step in steps)
            == result.stats.drafted
            < sum(len(m.drafts) for m in sent)
        )
        assert result.stats.accepted > 0
        assert verify_request(request_id, audited(world, request_id), target).verdict == "pass", tree


class Silent:
    """A drafter that never proposes anything."""

    name = "silent"

    def start(self, prompt, params, seed):
        return self

    def propose(self, context, k, tree=False, floor=0.0):
        return EMPTY

    def accept(self, context):
        pass

    def finish(self, context):
        pass


def test_the_draft_lane_proposes_the_grammar_s_forced_tokens(models):
    """Behind a drafter that proposes nothing, steps still verify drafts: the drafting lane's own
    matcher follows each request's context and puts the tokens the grammar forces first."""
    target, _ = models
    params = GREEDY["flags"]
    world = World(target)
    world.up()
    world.drafter_server("ngram").sources["ngram"] = Silent()
    request_id = served(world, params, "ngram", 8)
    result = world.result(request_id)
    assert result is not None and result.tokens == plain(target, params)
    assert result.stats.drafted > 0 and result.stats.accepted > 0
    steps = [e for e in audited(world, request_id) if isinstance(e, StepEvent) and e.drafted]
    assert steps and all(step.drafter == "grammar" for step in steps)


def test_lane_restarts_mid_request_continue_the_grammar_exactly(models):
    """The verify lane and the draft lane die mid-request: the re-primed verify lane walks its grammar
    through the output in the prefix and the pending token the Open names; the new draft lane's
    drafter follows the context from scratch. The output is plain decoding's, the audit passes."""
    target, _ = models
    for params in (GREEDY["short"], SEEDED):
        want = plain(target, params)
        world = World.paced(target)  # drafts from the draft lane: a middle to kill both lanes in
        world.up()
        request_id = served(world, params, "ngram", 3, until=30)
        world.down("verify")
        world.down("draft")
        world.up("verify", "draft")
        world.run()
        result = world.result(request_id)
        assert result is not None and result.tokens == want
        (reprime,) = [s.message for s in world.sent if isinstance(s.message, Open) and not s.message.sample]
        assert reprime.prompt_length == len(prompt_of(target)) < len(reprime.tokens)
        assert reprime.pending == want[len(reprime.tokens) - reprime.prompt_length]
        assert verify_request(request_id, audited(world, request_id), target).verdict == "pass"


def test_a_re_prime_the_grammar_cannot_follow_is_refused_not_served(models):
    target, _ = models
    world = World(target)
    prompt, params = prompt_of(target), GREEDY["flags"]
    doc = target.tokenizer.encode('{"ok": true')
    base = Open(request_id="r", step=3, tokens=[*prompt, *doc[:-1]], params=params, seed=1, sample=False,
                prompt_length=len(prompt))  # fmt: skip
    for open_, says in (
        (base, "pending token"),  # without it the lane cannot know where the grammar stands
        (msgspec.structs.replace(base, pending=BAD), "does not follow its response_format"),
    ):
        reply = world.verifier.open(open_)
        assert reply is not None and reply.kind == "bad_request" and says in reply.message
    assert world.verifier.open(msgspec.structs.replace(base, pending=doc[-1])) is None  # being prefilled


def test_admission_compiles_the_format_and_refuses_what_the_library_cannot_follow(models):
    target, _ = models
    world = World(target)
    refused = {
        "a type that does not exist": schema_format({"type": "objekt"}),
        "a dangling $ref": schema_format({"$ref": "#/nowhere"}),
        "too large to keep": schema_format({"type": "object", "description": "x" * MAX_FORMAT_CHARS}),
    }
    for name, fmt in refused.items():
        reply, sends = world.hub.submit(
            Submit(prompt="ab", params=SamplingParams(response_format=fmt)), world.now
        )
        assert isinstance(reply, ErrorReply) and reply.kind == "bad_request", name
        assert reply.message.startswith("response_format") and sends == [], (name, reply.message)


def test_audit_verify_applies_the_grammar_masks(models):
    """Sampled drafts from the model drafter (its rows masked, the forced tokens' rows one-hot: with
    top-k 3 the model's own row often has no mass on a forced token) pass; the same greedy record read
    as if the request had no format fails: the check applies the masks."""
    target, draft = models
    sampled = msgspec.structs.replace(SEEDED, temperature=1.0, top_k=3)
    events = audited_run(target, sampled, ModelSource(draft, target), k=3, prompt=prompt_of(target))
    steps = [e for e in events if isinstance(e, StepEvent)]
    assert any(s.drafter == "model" for s in steps) and any(s.drafter == "grammar" for s in steps)
    assert verify_request("req", events, target, draft).verdict == "pass"

    greedy = audited_run(target, GREEDY["flags"], NoDraftSource(), k=0, prompt=prompt_of(target))
    assert verify_request("req", greedy, target).verdict == "pass"
    free = msgspec.to_builtins(msgspec.structs.replace(GREEDY["flags"], response_format=None))
    opened = msgspec.structs.replace(greedy[0], settings={**greedy[0].settings, "params": free})
    assert verify_request("req", [opened, *greedy[1:]], target).verdict == "fail"
    other = msgspec.to_builtins(
        msgspec.structs.replace(GREEDY["flags"], response_format=schema_format(FLAGS, "x"))
    )
    opened = msgspec.structs.replace(greedy[0], settings={**greedy[0].settings, "params": other})
    assert verify_request("req", [opened, *greedy[1:]], target).verdict == "pass"  # the name is only a label


def test_bench_structured_checks_identity_and_validity(models, monkeypatch):
    """`speclanes bench structured` (one small workload here): constrained rows compared with plain
    constrained decoding and checked as JSON; the free-text row is a speed reference only."""
    from pipeline.bench import structured_bench

    target, _ = models
    monkeypatch.setattr(structured_bench, "WORKLOADS", {"flags": (PROMPT_TEXT, FLAGS)})
    results = structured_bench.run(target, ["none", "ngram"], 1, SamplingParams(max_tokens=120))
    rows = results["flags"]["drafters"]
    assert list(rows) == ["free", "none", "ngram"]
    assert rows["ngram"]["identical_to_none"] and rows["ngram"]["json_problem"] is None
    assert (
        rows["ngram"]["mean_accepted_length"] > 1
        and rows["none"]["speedup"] == rows["none"]["cpu_speedup"] == 1.0
    )
    assert rows["free"]["identical_to_none"] is None and not rows["free"]["identity_expected"]
    table = structured_bench.render(results).splitlines()
    assert len(table) == 4 and table[-1].split()[:2] == ["flags", "ngram"] and table[-1].endswith("yes")
