"""Prompt prefixes copied instead of computed (`workers/prefix_reuse.py`, `KVCache.adopt`): the
runtime gives the same bits as a full prefill (`np.array_equal`, never a tolerance) on the
row-invariant backends, the verify lane copies what its caches hold (the n choices of one
request: one prefill, then one row each), and the numpy reference, which is not row-invariant,
copies nothing."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pipeline.decoding.sampling import SamplingParams
from pipeline.model import Model, load_model
from pipeline.protocol.messages import Open, Opened, Verified, Verify
from pipeline.workers.prefix_reuse import shared_length
from pipeline.workers.verifier import Verifier

from .orchestration_harness import FakeLane
from .tinymodel import TinySpec, write_tiny_gguf

SPECS = {
    "q4_1-gqa": TinySpec(quant="Q4_1", context=160, seed=31),
    "qwen2-bias-q8_0": TinySpec(architecture="qwen2", qkv_bias=True, quant="Q8_0", context=160, seed=32),
}
SAMPLED = SamplingParams(temperature=0.9, max_tokens=8)
TOKENS = st.integers(3, 266)


@pytest.fixture(
    scope="module", params=[("q4_1-gqa", "native"), ("q4_1-gqa", "torch"), ("qwen2-bias-q8_0", "native")],
    ids="-".join,
)  # fmt: skip
def fast(request, tmp_path_factory):
    spec, backend = request.param
    path = tmp_path_factory.mktemp("reuse") / "tiny.gguf"
    write_tiny_gguf(path, SPECS[spec])
    return load_model(path, backend)


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    path = tmp_path_factory.mktemp("reuse") / "tiny.gguf"
    write_tiny_gguf(path, SPECS["q4_1-gqa"])
    return load_model(path, "native")


class Rows:
    """The model, counting the rows each forward carries (the lane's only cost a copy saves)."""

    def __init__(self, model) -> None:
        self.model, self.forwards, self.asked = model, [], []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_batch(self, batch, **kwargs):
        self.forwards.append(sum(len(item[1]) for item in batch))
        return self.model.forward_batch(batch, **kwargs)

    def forward_features(self, batch, **kwargs):  # the verify lane's forwards
        self.forwards.append(sum(len(item[1]) for item in batch))
        self.asked.append(kwargs.get("all_logits", True))
        return self.model.forward_features(batch, **kwargs)


def feed(model, cache, tokens: Sequence[int], size: int) -> np.ndarray:
    rows = [model.forward(cache, tokens[i : i + size]) for i in range(0, len(tokens), size)]
    return np.concatenate(rows) if rows else np.empty((0, model.cfg.vocab_size), np.float32)


# --- the runtime ------------------------------------------------------------------------


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    prompt=st.lists(TOKENS, min_size=1, max_size=60),
    shared=st.integers(0, 60),
    donor_tail=st.lists(TOKENS, max_size=20),
    chunk=st.integers(1, 40),
)
def test_a_copied_prefix_then_the_rest_gives_a_full_prefills_bits(fast, prompt, shared, donor_tail, chunk):
    """The donor fed its own prompt (the shared part, then its own tail) in chunks; the receiver
    copies what they share (never its last token) and forwards the rest in one block."""
    model = fast
    donor_tokens = prompt[:shared] + donor_tail
    donor = model.new_cache(capacity=4)  # grows on the way: reallocation must not matter
    feed(model, donor, donor_tokens, chunk)
    copied = min(shared_length(prompt, donor_tokens), len(prompt) - 1)
    mine = model.new_cache(capacity=2)
    mine.adopt(donor, copied)
    got = model.forward(mine, prompt[copied:])
    whole = model.new_cache()
    want = model.forward(whole, prompt)
    assert np.array_equal(got, want[copied:])
    n = len(prompt)
    assert mine.length == whole.length == n
    assert np.array_equal(mine.k[..., :n], whole.k[..., :n]) and np.array_equal(
        mine.v[:, :, :n], whole.v[:, :, :n]
    )


def test_adopt_refuses_positions_the_source_does_not_hold(native):
    source = native.new_cache()
    native.forward(source, [5, 6, 7])
    with pytest.raises(ValueError, match="cannot adopt 4"):
        native.new_cache().adopt(source, 4)


def test_shared_length():
    assert shared_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert shared_length([1, 2, 3], [1, 9, 3]) == 1
    assert shared_length([1], [2]) == shared_length([], [1]) == 0


# --- the verify lane ----------------------------------------------------------------------


def opens(prompt: Sequence[int], n: int, seed: int = 7, prefix: str = "c") -> list[Open]:
    return [
        Open(
            request_id=f"{prefix}{i}", step=0, tokens=list(prompt), params=SAMPLED, seed=seed + i, capacity=64
        )
        for i in range(n)
    ]


def drain(verifier: Verifier, messages: list) -> dict[str, Opened | Verified]:
    replies = verifier.handle(messages)
    while verifier.busy():
        replies += verifier.handle([])
    return {reply.request_id: reply for reply in replies}


def same_state(a: Verifier, b: Verifier, request_id: str) -> None:
    x, y = a.requests[request_id].target, b.requests[request_id].target
    n = x.cache.length
    assert n == y.cache.length and x.context == y.context
    assert np.array_equal(x.cache.k[..., :n], y.cache.k[..., :n])
    assert np.array_equal(x.cache.v[:, :, :n], y.cache.v[:, :, :n])


def lane(model, chunk: int = 128) -> Verifier:
    return Verifier(model, FakeLane(), chunk, row_costs=[])  # no t(rows) calibration: not needed here


def plain(model, chunk: int = 128) -> Verifier:
    verifier = lane(model, chunk)
    verifier.reuse.enabled = False
    return verifier


def test_n_choices_opened_together_cost_one_prefill_and_one_row_each(native):
    """Four Opens of one prompt in one batch (as a request with n = 4 sends them): the first is
    prefilled, the other three wait one forward, copy all but the last token, and forward it. The
    first tokens, and the next step's, are those of prefills done separately."""
    prompt = list(range(40, 77))
    model = Rows(native)
    verifier, reference = lane(model), plain(native)
    got = drain(verifier, opens(prompt, 4))
    assert model.forwards == [len(prompt), 3]
    assert verifier.reuse.reused == verifier.lane.state.prompt_tokens_reused == 3 * (len(prompt) - 1)
    want = drain(reference, opens(prompt, 4))
    assert {r: (o.token, o.u) for r, o in got.items()} == {r: (o.token, o.u) for r, o in want.items()}
    steps = [
        Verify(request_id=r, step=1, position=len(prompt), pending=o.token, drafts=[o.token, 50])
        for r, o in got.items()
    ]
    after, expected = drain(verifier, steps), drain(reference, steps)
    for request_id in got:
        assert (after[request_id].tokens, after[request_id].accepted) == (
            expected[request_id].tokens, expected[request_id].accepted,
        )  # fmt: skip
        same_state(verifier, reference, request_id)
    spans = verifier.lane.telemetry.spans("prefill")
    assert sorted(s.attributes["speclanes.prefix_reused"] for s in spans) == [0, 36, 36, 36]


def test_a_lone_prompt_is_fed_whole_and_one_beside_a_decoding_request_in_chunks(native, tmp_path):
    """Chunks bound the delay a prompt costs the requests decoding beside it; with none there, the
    prompt takes one forward (one pass over the weights), with the bits of a chunked prefill. The
    numpy reference, which is not row-invariant, is always fed in chunks: its bits would otherwise
    depend on who else was in the lane."""
    first, second = list(range(100, 140)), list(range(150, 190))
    model = Rows(native)
    verifier, reference = lane(model, chunk=16), plain(native, chunk=16)
    reference.row_invariant = False  # the reference feeds its prompts in chunks, as before
    got = drain(verifier, opens(first, 1, prefix="a"))["a0"]
    want = drain(reference, opens(first, 1, prefix="a"))["a0"]
    assert model.forwards == [40] and (got.token, got.u) == (want.token, want.u)
    same_state(verifier, reference, "a0")
    step = Verify(request_id="a0", step=1, position=len(first), pending=got.token, drafts=[9, 10])
    stepped = drain(verifier, [step, *opens(second, 1, prefix="b")])  # "a0" decodes: 16 rows a forward
    assert model.forwards[1:] == [3 + 16, 16, 8]
    # The LM head reads every row of a verify step, and only a prompt chunk's last.
    assert model.asked == [[False], [True, False], [False], [False]]
    assert stepped["a0"].tokens == drain(reference, [step])["a0"].tokens
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, SPECS["q4_1-gqa"])
    numpy = Rows(load_model(path, "numpy"))
    drain(lane(numpy, chunk=16), opens(first, 1, prefix="a"))
    assert numpy.forwards == [16, 16, 8]


def test_a_prompt_that_begins_like_a_live_request_copies_it(native):
    """A later request with the same system prompt and its own question: the system prompt is
    copied from the request still decoding, the question computed."""
    system, first, second = list(range(100, 130)), [7, 8, 9, 10], [11, 12, 13, 14, 15, 16]
    model = Rows(native)
    verifier, reference = lane(model), plain(native)
    drain(verifier, opens(system + first, 1, prefix="a"))
    drain(reference, opens(system + first, 1, prefix="a"))
    got = drain(verifier, opens(system + second, 1, prefix="b"))["b0"]
    want = drain(reference, opens(system + second, 1, prefix="b"))["b0"]
    assert model.forwards[-1] == len(second) and verifier.reuse.reused == len(system)
    assert (got.token, got.u) == (want.token, want.u)
    same_state(verifier, reference, "b0")


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    base=st.lists(TOKENS, min_size=1, max_size=40),
    prompts=st.lists(
        st.tuples(st.integers(0, 40), st.lists(TOKENS, max_size=12), st.integers(0, 2)),
        min_size=2,
        max_size=5,
    ),
    chunk=st.sampled_from([3, 16, 128]),
)
def test_any_mix_of_shared_prompts_and_arrivals_gives_separate_prefills_bits(native, base, prompts, chunk):
    """Prompts sharing prefixes of any length, arriving in waves (a wave is one inbox batch; each
    wave gets one forward before the next), prefilled in chunks: every first token, draw and
    cache equals what prefills without copying give, and every prompt position is either
    computed or copied, once."""
    model = Rows(native)
    verifier, reference = lane(model, chunk), plain(native, chunk)
    messages = [
        Open(
            request_id=f"r{i}", step=0, tokens=(base[:cut] + tail) or [5], params=SAMPLED, seed=i, capacity=64
        )
        for i, (cut, tail, _) in enumerate(prompts)
    ]
    got: dict[str, Opened | Verified] = {}
    for wave in range(3):
        arriving = [m for m, (_, _, w) in zip(messages, prompts, strict=True) if w == wave]
        got |= {reply.request_id: reply for reply in verifier.handle(arriving)}
    got |= drain(verifier, [])
    want = drain(reference, messages)
    assert {r: (o.token, o.u, o.draws) for r, o in got.items()} == {
        r: (o.token, o.u, o.draws) for r, o in want.items()
    }
    for request_id in want:
        same_state(verifier, reference, request_id)
    assert sum(model.forwards) + verifier.reuse.reused == sum(len(m.tokens) for m in messages)


def test_repriming_after_a_restart_copies_the_shared_prompt_and_carries_on(native):
    """A restarted lane is re-primed with each choice's accepted prefix (prompt and output): the
    choices share the prompt, so they copy it, and the state is the undisturbed one."""
    prompt = list(range(60, 90))
    reference = plain(native)
    opened = drain(reference, opens(prompt, 3))
    steps = [
        Verify(request_id=r, step=1, position=len(prompt), pending=o.token, drafts=[20 + i, 30 + i])
        for i, (r, o) in enumerate(sorted(opened.items()))
    ]
    drain(reference, steps)
    restarted = lane(native)
    reprimes = [  # what the orchestrator sends: the tokens the lost cache held, the draws, no sample
        Open(
            request_id=r, step=1, tokens=reference.requests[r].target.context, params=SAMPLED, seed=7 + i,
            draws=reference.requests[r].target.draws, sample=False, capacity=64, prompt_length=len(prompt),
        )
        for i, r in enumerate(sorted(opened))
    ]  # fmt: skip
    replies = drain(restarted, reprimes)
    assert all(reply.token is None for reply in replies.values())
    assert restarted.reuse.reused >= 2 * len(prompt)
    for request_id in opened:
        same_state(restarted, reference, request_id)
        assert restarted.requests[request_id].target.draws == reference.requests[request_id].target.draws


def test_the_numpy_reference_copies_nothing(tmp_path):
    """Not row-invariant: a copied prefix could move the next row's last bits, so it prefills."""
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(seed=33))
    model = Rows(Model.load(path))
    verifier = lane(model)
    drain(verifier, opens(list(range(40, 60)), 3))
    assert not verifier.reuse.enabled and verifier.reuse.reused == 0 and model.forwards == [60]
