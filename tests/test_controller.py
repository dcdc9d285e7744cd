"""The cost-model controller (`decoding.adaptive`): what it verifies follows the t(rows) curve,
the drafter's shares and what the target kept; neighbours in a batch cap it."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.decoding.adaptive import (
    NEIGHBOUR_SLOWDOWN,
    Controller,
    DepthAcceptance,
    RowCosts,
    node_probabilities,
)
from pipeline.decoding.tree import chain, offered

FLAT = [0.010] * 8 + [0.010 + 0.002 * r for r in range(1, 26)]  # t(rows) flat to 8 rows, then rising
GENTLE = [0.010 * (1 + 0.05 * r) for r in range(33)]  # each row costs 5% of a forward
STEEP = [0.010 * r for r in range(1, 34)]  # every row costs a full forward


def controller(curve: list[float], **kwargs) -> Controller:
    c = Controller(**kwargs)
    c.costs.calibrate(curve)
    return c


def test_a_flat_curve_verifies_the_confident_chain_and_a_steep_one_decodes_plainly():
    parents, shares = chain(7), [1.0] * 7  # 8 rows: the flat part
    assert controller(FLAT).cut(parents, shares) == list(range(7))
    assert controller(STEEP).cut(parents, shares) == []


def test_what_the_target_keeps_moves_the_cut():
    parents, shares = chain(12), [1.0] * 12
    c = controller(GENTLE)
    for _ in range(30):  # the target keeps two levels, never the third
        c.observe(13, 0.012, 0.013, offered(parents, shares, [0, 1]), accepted=2)
    assert c.cut(parents, shares) == [0, 1]
    for _ in range(40):
        c.observe(13, 0.012, 0.013, offered(parents, shares, list(range(12))), accepted=12)
    assert len(c.cut(parents, shares)) >= 8


def test_speculation_turns_off_and_probes_back():
    parents, shares = chain(6), [1.0] * 6
    c = controller(GENTLE)
    for _ in range(30):
        c.observe(7, 0.010, 0.011, [1.0], accepted=0)
    cuts = [len(c.cut(parents, shares)) for _ in range(60)]
    assert cuts.count(0) >= 50 and any(cuts)  # mostly plain, with probes


def test_a_tree_keeps_the_likely_branches_first():
    # Two branches under the root: 0 (share 0.8) -> 1, and 2 (share 0.2) -> 3.
    parents, shares = [-1, 0, -1, 2], [0.8, 1.0, 0.2, 1.0]
    c = controller([0.010, 0.010, 0.010, 0.030, 0.040])  # the fourth row costs 3x
    assert c.cut(parents, shares) == [0, 1]


def test_neighbours_cap_the_rows_to_the_flat_part_of_the_curve():
    parents, shares = chain(16), [1.0] * 16
    c = controller(FLAT)
    for _ in range(30):
        c.observe(17, 0.012, 0.013, offered(parents, shares, list(range(16))), accepted=16)
    alone = c.cut(parents, shares)
    crowded = c.cut(parents, shares, neighbours=5)  # 6 requests: 8 rows stay within 5% of t(6)
    assert len(alone) > len(crowded)
    assert 6 + len(crowded) <= c.costs.row_budget(6, 64)
    assert c.costs.ratio(6 + len(crowded)) <= c.costs.ratio(6) * 1.05


def test_a_sampling_drafter_is_asked_for_the_chain_that_pays():
    cheap, dear = controller(FLAT), controller(FLAT, draft_per_token=2.0)
    assert cheap.budget("model") > dear.budget("model")
    assert controller(FLAT).budget("ngram") == controller(FLAT).budget("auto") == 16


@given(
    st.lists(st.tuples(st.integers(-1, 30), st.floats(0.01, 1.0)), min_size=1, max_size=30),
    st.lists(st.floats(0.0, 0.05), min_size=33, max_size=33),
    st.integers(0, 8),
)
def test_every_cut_is_a_subtree(nodes, curve, neighbours):
    parents = [p if p < i else i - 1 for i, (p, _) in enumerate(nodes)]
    shares = [s for _, s in nodes]
    c = Controller()
    c.costs.calibrate([0.01, *sorted(curve)[1:]])
    kept = c.cut(parents, shares, neighbours)
    assert kept == sorted(kept)
    assert all(parents[i] < 0 or parents[i] in kept for i in kept)


@given(st.lists(st.floats(0.0, 1.0), min_size=1, max_size=20))
def test_node_probabilities_never_grow_down_a_path(shares):
    parents = chain(len(shares))
    probs = node_probabilities(parents, shares, DepthAcceptance())
    assert all(0.0 <= b <= a <= 1.0 for a, b in zip([1.0, *probs], probs, strict=False))


def test_an_uncalibrated_curve_learns_from_steps_a_calibrated_one_stays():
    learning, fixed = RowCosts(), RowCosts()
    fixed.calibrate([0.01, 0.01, 0.01])
    for rows in (1, 2, 3):
        learning.observe(rows, 0.01 * rows)
        fixed.observe(rows, 0.01 * rows)
    assert learning.ratio(3) == 3.0
    assert fixed.ratio(3) == 1.0


def test_each_drafter_is_judged_on_its_own_record():
    parents, shares = chain(8), [1.0] * 8
    c = controller(GENTLE)
    for _ in range(30):
        c.observe(9, 0.012, 0.013, offered(parents, shares, list(range(8))), accepted=8, drafter="suffix")
        c.observe(9, 0.012, 0.013, [1.0], accepted=0, drafter="ngram")
    assert len(c.cut(parents, shares, drafter="suffix")) == 8
    assert c.cut(parents, shares, drafter="ngram") == []


def test_the_lane_keeps_its_calibration_per_model_runtime_and_cpu(tmp_path, monkeypatch):
    from pipeline.model import calibration, load_model
    from pipeline.model.store import form_directory

    from .tinymodel import TinySpec, write_tiny_gguf

    monkeypatch.setenv("SPECLANES_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, TinySpec(quant="Q8_0", seed=3))
    model = load_model(path, "native")
    first = calibration.stored_row_seconds(model, path)
    assert len(first) == max(calibration.ROWS) and first[0] > 0
    assert all(b >= a for a, b in itertools.pairwise(first) if a and b)  # never cheaper with more rows
    monkeypatch.setattr(calibration, "measure", lambda *_: pytest.fail("measured again"))
    again = load_model(path, "native")
    assert calibration.stored_row_seconds(again, path) == first
    assert calibration.row_seconds(again) == first  # the curve read back is that model's curve
    (entry,) = form_directory(path, "calibration").glob("*.json")
    entry.write_text("garbage")
    monkeypatch.undo()
    monkeypatch.setenv("SPECLANES_CACHE", str(tmp_path / "cache"))
    assert len(calibration.stored_row_seconds(load_model(path, "native"), path)) == max(calibration.ROWS)
    monkeypatch.setattr(calibration, "library_key", lambda: "other kernels")  # a new build: a new curve
    monkeypatch.setattr(calibration, "measure", lambda *_: [1.0] * max(calibration.ROWS))
    assert calibration.stored_row_seconds(load_model(path, "native"), path) == [1.0] * max(calibration.ROWS)


def test_a_depth_never_verified_is_trusted_like_the_deepest_that_was():
    """After steps that kept all of 5 verified levels, the sixth level and beyond are worth a try
    (a fixed prior at unverified depths let the verified depth creep up one level a step)."""
    parents, shares = chain(16), [1.0] * 16
    c = controller(GENTLE)
    for _ in range(3):
        c.observe(6, 0.012, 0.013, offered(parents[:5], shares[:5], list(range(5))), accepted=5)
    acceptance = c.depths("")
    assert acceptance.alpha(9) == pytest.approx(acceptance.alpha(5)) and acceptance.alpha(5) > 0.85
    trusted = len(c.cut(parents, shares))
    assert trusted > 8
    for _ in range(10):  # the target stops keeping at the third level: what lies below it loses credit
        c.observe(17, 0.012, 0.013, offered(parents, shares, [0, 1]), accepted=2)
    assert len(c.cut(parents, shares)) < trusted


def test_calibration_takes_the_usual_cost_not_a_lucky_run(monkeypatch):
    """Every round times every row count in turn; the median is kept, so one fast forward (a quiet
    moment on a shared machine) does not make a row count look cheap."""
    from pipeline.model import calibration

    class Clock:
        now, calls = 0.0, 0

    class Timed:
        cfg = type("Cfg", (), {"context_length": 4096, "vocab_size": 100})()

        def new_cache(self, capacity):
            return type("Cache", (), {"length": 0, "truncate": lambda self, n: None})()

        def forward(self, cache, tokens, all_logits=True):
            Clock.calls += 1
            lucky = len(tokens) == 8 and Clock.calls % 5 == 0  # one 8-row forward in a few is fast
            Clock.now += 0.001 * (1 + 0.2 * len(tokens)) * (0.3 if lucky else 1.0)

    monkeypatch.setattr(calibration.time, "perf_counter", lambda: Clock.now)
    seconds = calibration.measure(Timed(), rows=(1, 4, 8))
    assert seconds[7] == pytest.approx(0.001 * 2.6)


CONVEX = [0.010 * (1 + 0.1 * r + 0.004 * r * r) for r in range(33)]  # rows dearer the more there are


@given(
    st.lists(st.tuples(st.integers(-1, 30), st.floats(0.0, 1.0)), min_size=1, max_size=30),
    st.lists(st.floats(0.0002, 0.004), min_size=32, max_size=32),  # a row adds 2% to 40% of t(1)
    st.lists(st.integers(0, 4), max_size=6),
    st.integers(0, 4),
)
def test_a_tree_under_the_floor_is_never_worth_verifying(nodes, steps, kept, neighbours):
    """`Controller.floor` is a bound, not a guess: a tree whose first nodes all have less share
    than it is cut to nothing, whatever the curve, the record of the drafter and the neighbours."""
    c = Controller()
    c.costs.calibrate(list(itertools.accumulate([0.01, *steps])))
    for accepted in kept:  # some record: alpha_1 anywhere from the prior to well above 1
        c.observe(5, 0.012, 0.013, [0.2, 0.5, 1.0, 1.0][: max(1, accepted)], accepted)
    floor = c.floor("")
    assert floor > 0
    parents = [p if p < i else i - 1 for i, (p, _) in enumerate(nodes)]
    shares = [s if p >= 0 else floor * 0.999 for p, (_, s) in zip(parents, nodes, strict=True)]
    assert c.cut(parents, shares, neighbours) == []  # a fresh controller does not probe yet


def test_on_a_convex_curve_the_floor_is_where_one_node_starts_to_pay():
    c = controller(CONVEX)
    floor = c.floor("")
    assert c.cut([-1], [floor * 0.99]) == []
    assert c.cut([-1], [floor * 1.01]) == [0]
    assert controller(CONVEX, fixed=4).floor("") == 0.0  # a fixed k takes every proposal


def test_no_room_beside_the_neighbours_means_no_draft_is_asked_for():
    """A crowded forward (steep past one row here) has no room for a request's drafts: the
    controller says so before the drafter is asked, where alone it may ask for all it can use."""
    c = controller([0.010, 0.0101, *[0.010 + 0.004 * r for r in range(2, 33)]])  # 2 rows flat, then 40% a row
    assert c.room(0, 16) == 16
    assert c.room(1, 16) == 0  # 2 rows are plain already; a third costs 40%
    assert controller(FLAT).room(3, 16) == 4  # 4 requests' rows, and 4 more within the flat part
    assert Controller(fixed=5).room(7, 5) == 5  # a k the user fixed is theirs


def test_the_neighbours_slowdown_is_shared_by_every_request_of_the_forward():
    """Every request of a forward may add rows in the same step, so each may slow it by its share of
    NEIGHBOUR_SLOWDOWN: here each row costs 2% of a forward, and all of them together stay within it."""
    c = controller([0.010 * (1 + 0.02 * r) for r in range(33)])
    assert c.room(1, 16) == 1  # 2 requests: 2.5% each, one row
    assert c.room(7, 16) == 0  # 8 requests: 0.625% each, not a row
    for neighbours in range(1, 12):
        base, room = neighbours + 1, c.room(neighbours, 16)
        total = c.costs.ratio(base + base * room) / c.costs.ratio(base)  # every request took its room
        assert total <= 1 + NEIGHBOUR_SLOWDOWN + 1e-12, (neighbours, room, total)


def test_a_free_drafter_is_asked_while_its_proposals_pay_for_the_wait():
    """In the pipeline a proposal is a round trip to the draft lane. Where the target keeps nothing
    of what comes back (open chat for an n-gram drafter) the wait is pure loss: steps go plain without
    asking, with a probe now and then; where proposals are kept (a quote), asking goes on."""
    curve = GENTLE
    chat, quote = controller(curve), controller(curve)
    for c, accepted in ((chat, 0), (quote, 6)):
        for _ in range(40):
            if c.budget("ngram"):  # asked: a 2 ms wait beside a 10 ms forward
                rows = 1 + (6 if accepted else 0)
                c.observe(rows, curve[rows - 1], curve[rows - 1] + 0.002, [1.0] * (rows - 1), accepted)
            else:
                c.observe(1, curve[0], curve[0], [], 0)
    asks = [chat.budget("ngram") for _ in range(60)]
    assert asks.count(0) >= 50 and any(asks)  # mostly plain, with probes
    assert all(quote.budget("ngram") == 16 for _ in range(20))
    assert chat.overhead < 0.05  # the wait is the asking's, not charged to every step
    in_process = controller(curve)  # a proposal in microseconds costs next to nothing to ask for
    for _ in range(40):
        in_process.budget("ngram")
        in_process.observe(1, curve[0], curve[0] + 0.000005, [], 0)
    assert in_process.asking.seconds < 0.001
