"""How much to speculate each step: a cost model over the runtime's t(rows) curve.

A step verifies a draft tree of R nodes in one forward of R + 1 rows. If node i is kept with
probability p_i, the step emits 1 + sum(p_i) tokens on average and costs t(R + 1) plus the
step's fixed overhead (messages, bookkeeping; in the verify lane's shared forwards, the other
requests' rows too, which the step waits for alike), so the controller keeps the R best nodes that
maximise (1 + sum p) / (t(R + 1) / t(1) + overhead). R = 0 is plain decoding. Because the cut
comes after the proposal, free drafters (n-gram, suffix) may propose generously and only what
pays is verified; the model drafter, whose drafts cost a forward each, is asked for the chain
length that pays (`budget`).

- t(rows) comes from the runtime's own calibration (`model.calibration`); only without one is
  it learnt from what steps measure.
- p_i = p(parent) * min(1, alpha_d * share_i): share_i is the drafter's own estimate (its
  candidates' vote at that branch), alpha_d a per-drafter, per-depth calibration of those
  estimates learnt from what the target kept, so a drafter that is over-confident at depth 5 is
  discounted there, and `auto`'s n-gram chains and suffix chains are each judged on their record.
- Neighbours: in a batched verify lane other requests' rows share the forward, so a request
  with neighbours may only add rows while the forward stays within its share of
  `NEIGHBOUR_SLOWDOWN` of the time it takes without any speculation (`RowCosts.row_budget`): its
  speculation must not make their steps slower. Every request of the forward may add rows at once,
  so each gets 1/N of the slowdown (on a curve that rises evenly, all N together then stay within
  it). Where that leaves no room (`Controller.room`), no draft is asked for.
- Asking: a free drafter's proposal is not free where it comes from the draft lane (a round trip
  while the forward waits), so whether to ask at all is judged by what asking steps gained against
  the rows and the wait they cost (`Asking`); the wait is charged there, not to the step overhead.
While nothing pays it probes now and then (exponential back-off) so a change is noticed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.decoding.drafters.kinds import paid_per_draft
from pipeline.decoding.tree import chain, depths

K_LIMIT = 32
NEIGHBOUR_SLOWDOWN = 0.05
PRIOR_STEPS = 3  # what `Asking`'s hopeful start weighs, in steps that asked
PROBE_NODES = 1  # a probe asks the target about the best node only: each row of it costs 10-20% of a step


def prior_verify_ratio(rows: int) -> float:
    """t(rows) / t(1) before anything is known about the runtime."""
    return 1.0 if rows <= 1 else 1.3 if rows <= 8 else 1.3 + 0.09 * (rows - 8)


@dataclass
class RowCosts:
    """t(rows) in seconds, from calibration and then from what steps measured (EWMA)."""

    smoothing: float = 0.2
    seconds: dict[int, float] = field(default_factory=dict)
    calibrated: bool = False
    _ratios: dict[int, float] = field(default_factory=dict)  # `ratio` by rows, until `seconds` changes
    _cheapest: float | None = None  # `cheapest_row`, likewise

    def calibrate(self, seconds_by_rows: Sequence[float]) -> None:
        """`seconds_by_rows[r - 1]` is the calibrated t(r) (0 where not measured). A calibrated
        curve is kept as it is: a step's measured time also holds the lanes' messaging and, in a
        batched lane, other requests' rows, which would bend the curve."""
        measured = {rows: float(s) for rows, s in enumerate(seconds_by_rows, start=1) if s > 0}
        if 1 in measured:
            self.seconds, self.calibrated = measured, True
            self._forget()

    def observe(self, rows: int, seconds: float) -> None:
        if self.calibrated:
            return
        old = self.seconds.get(rows)
        self.seconds[rows] = seconds if old is None else old + self.smoothing * (seconds - old)
        self._forget()

    def _forget(self) -> None:
        self._ratios.clear()
        self._cheapest = None

    def ratio(self, rows: int) -> float:
        """t(rows) / t(1), interpolated between measured row counts, extrapolated past the last
        (kept by row count: the controller asks for every count up to its proposal's size each step)."""
        ratio = self._ratios.get(rows)
        if ratio is None:
            ratio = self._ratios[rows] = self._ratio(rows)
        return ratio

    def _ratio(self, rows: int) -> float:
        one = self.seconds.get(1)
        if not one or len(self.seconds) < 2:
            return prior_verify_ratio(rows)
        known = sorted(self.seconds)
        if rows in self.seconds:
            return self.seconds[rows] / one
        if rows > known[-1]:  # grow with the last measured slope, never below flat
            a, b = known[-2], known[-1]
            slope = max(0.0, (self.seconds[b] - self.seconds[a]) / (b - a))
            return (self.seconds[b] + slope * (rows - b)) / one
        return float(np.interp(rows, known, [self.seconds[r] for r in known])) / one

    def cheapest_row(self) -> float:
        """The least (t(1 + R) - t(1)) / R over t(1), R = 1..2 * K_LIMIT: what a draft row adds to a
        step at the least, on average over the rows a forward carries."""
        if self._cheapest is None:
            self._cheapest = min((self.ratio(1 + r) - self.ratio(1)) / r for r in range(1, 2 * K_LIMIT + 1))
        return self._cheapest

    def row_budget(self, base_rows: int, limit: int, slowdown: float = NEIGHBOUR_SLOWDOWN) -> int:
        """The most rows (up to `limit`) a forward may carry while it costs at most
        1 + `slowdown` times a forward of `base_rows`."""
        ceiling = self.ratio(base_rows) * (1 + slowdown)
        rows = base_rows
        while rows < limit and self.ratio(rows + 1) <= ceiling:
            rows += 1
        return rows


@dataclass
class DepthAcceptance:
    """alpha_d: at depth d, how often the target kept one of the offered children, over the sum
    of their shares (decayed, so it follows the request). Each depth's record is weighed
    against the estimate of the depth above it (the first depth's against `prior`): a depth
    never verified is taken to be as reliable as the deepest one that was. With a fixed prior
    instead, the verified depth crept up one level a step (0.6 ** extra levels never pays), and a
    request quoting its input was still verifying 5 of 16 correct nodes when it ended."""

    prior: float = 0.6
    weight: float = 1.0
    decay: float = 0.95
    kept: list[float] = field(default_factory=lambda: [0.0] * (K_LIMIT + 1))  # by depth (decayed counts)
    offered: list[float] = field(default_factory=lambda: [0.0] * (K_LIMIT + 1))

    def alphas(self, deepest: int) -> list[float]:
        """[alpha_0 (unused: 1), alpha_1, ..., alpha_deepest]."""
        out, above = [1.0], self.prior
        for depth in range(1, deepest + 1):
            d = min(depth, K_LIMIT)
            above = (self.kept[d] + above * self.weight) / (self.offered[d] + self.weight)
            out.append(above)
        return out

    def alpha(self, depth: int) -> float:
        return self.alphas(depth)[depth]

    def observe(self, offered: Sequence[float], accepted: int) -> None:
        """`offered[d - 1]`: the shares offered at depth d below the node kept at depth d - 1;
        the target kept depths 1..accepted."""
        for depth, shares in enumerate(offered[:K_LIMIT], start=1):
            self.kept[depth] = self.kept[depth] * self.decay + (depth <= accepted)
            self.offered[depth] = self.offered[depth] * self.decay + shares


def node_probabilities(
    parents: Sequence[int], shares: Sequence[float], acceptance: DepthAcceptance
) -> list[float]:
    """p_i for each node (parents come before children), see the module docstring."""
    node_depths = depths(parents)
    alphas = acceptance.alphas(max(node_depths, default=0))
    probs: list[float] = []
    for d, parent, share in zip(node_depths, parents, shares, strict=True):
        above = 1.0 if parent < 0 else probs[parent]
        probs.append(above * min(1.0, alphas[d] * share))
    return probs


@dataclass
class Asking:
    """Whether asking a free drafter (n-gram, suffix, `auto`) for a proposal pays for the wait. In
    process, and in the verify lane, a proposal takes microseconds; from the draft lane
    (`run.draft_in_verify_lane` false) it is a round trip, a millisecond or more in which a single
    stream's forward waits. A step that asks gains what the cut kept and the target accepted, for the
    rows it verified and the wait; one that does not is a plain step. While asking does not pay (open
    chat, where n-grams rarely match), steps go plain without the trip, asking again now and then
    (exponential back-off) so a change is noticed."""

    # Each a mean over the steps that asked, starting from a hopeful prior worth PRIOR_STEPS of them,
    # then an EWMA with a long memory: a drafter's hits come in clusters (a phrase repeated, a list's
    # pattern) between runs of misses, and an estimate that forgot within ten steps stopped asking in
    # every gap (11% more steps in process on chat prompts, where a proposal costs microseconds).
    seconds: float = 0.0  # a proposal's wait, over t(1)
    gain: float = 1.0  # tokens a step that asked kept beyond the plain step's one
    rows: float = 0.0  # t(rows) / t(1) - 1 of a step that asked
    smoothing: float = 0.03
    asked: bool = False  # the last `ask` said to ask
    _observed: int = 0
    _skipped: int = 0
    _probe_after: int = 4

    def pays(self, overhead: float) -> bool:
        return (1.0 + self.gain) / (1.0 + self.rows + overhead + self.seconds) >= 1.0 / (1.0 + overhead)

    def ask(self, overhead: float) -> bool:
        if self.pays(overhead):
            self._skipped, self._probe_after = 0, 4
        else:
            self._skipped += 1
            if self._skipped >= self._probe_after:
                self._skipped, self._probe_after = 0, min(self._probe_after * 2, 256)
        self.asked = self._skipped == 0
        return self.asked

    def observe(self, seconds: float, gain: int, rows: float) -> None:
        self._observed += 1
        a = max(self.smoothing, 1.0 / (self._observed + PRIOR_STEPS))
        self.seconds += a * (seconds - self.seconds)
        self.gain += a * (gain - self.gain)
        self.rows += a * (rows - self.rows)


@dataclass
class Controller:
    """Fixed node count when `fixed` is set; otherwise the cost model of the module docstring.
    Its limits come from a `Speculation` (0..K_LIMIT, 1..K_LIMIT)."""

    fixed: int | None = None
    k_max: int = 16
    costs: RowCosts = field(default_factory=RowCosts)
    acceptance: dict[str, DepthAcceptance] = field(default_factory=dict)  # per drafter (`Proposal.drafter`)
    # A step's seconds beyond t(its own rows), over t(1) (EWMA): the loop around the forward and, in a
    # forward shared with other requests, their rows (a crowded forward makes a row of one's own
    # relatively cheaper; `room` keeps that from slowing the neighbours).
    overhead: float = 0.05
    draft_per_token: float = 0.0  # a paid drafter's seconds per draft token, over t(1) (EWMA)
    asking: Asking = field(default_factory=Asking)  # whether a free drafter's proposal pays its wait
    smoothing: float = 0.2
    _plain_steps: int = 0
    _probe_after: int = 4

    def budget(self, drafter: str) -> int:
        """How many nodes to ask `drafter` for. A free drafter gets all it may give, and the cut
        decides, while asking it pays for the wait (`Asking`). A drafter whose drafts each cost a
        forward (`kinds.paid_per_draft`: a draft model, a learned head) gets the chain length that
        pays. Its chains carry its own name, so its calibration is used."""
        if self.fixed is not None:
            return self.fixed
        if not paid_per_draft(drafter):
            return self.k_max if self.asking.ask(self.overhead) else 0
        probs = node_probabilities(chain(self.k_max), [1.0] * self.k_max, self.depths(drafter))
        best = self._best_count(probs, per_node=self.draft_per_token)
        return best or self._probe(best)

    def depths(self, drafter: str) -> DepthAcceptance:
        """The per-depth calibration of `drafter`'s own estimates (each drafter errs its own way)."""
        return self.acceptance.setdefault(drafter, DepthAcceptance())

    def floor(self, drafter: str) -> float:
        """The least share of the candidates' weight that a proposal's likeliest first node needs
        for `drafter`'s tree to be worth building, 0 when every proposal is taken (a fixed k).

        Below it no cut of the tree beats plain decoding, so the drafter need not merge it nor the
        controller rank it: every node's p is at most alpha_1 times that share (p never grows down
        a path), and with every p under c * rho_0 (c the least a row adds on average, rho_0 =
        1 / (1 + overhead) the plain step's rate) R nodes earn 1 + sum(p) < rho_0 * (1 + overhead +
        R * c), which is at most rho_0 times what they cost. Weak guesses (a token that followed one
        earlier newline) were half of a chat request's steps, each costing a merge and a cut."""
        if self.fixed is not None:
            return 0.0
        alpha = self.depths(drafter).alpha(1)
        rate = 1.0 / (self.costs.ratio(1) + self.overhead)
        return max(0.0, self.costs.cheapest_row()) * rate / max(alpha, 1e-6)

    def cut(
        self, parents: Sequence[int], shares: Sequence[float], neighbours: int = 0, drafter: str = ""
    ) -> list[int]:
        """The nodes to verify (ascending, closed under parents) out of `drafter`'s proposal."""
        n = len(parents)
        if n == 0:
            return []
        if self.fixed is not None:
            return list(range(min(self.fixed, n)))
        cap = self.room(neighbours, n)
        probs = node_probabilities(parents, shares, self.depths(drafter))
        ranked = sorted(range(n), key=lambda i: (-probs[i], i))  # a parent before its children
        best = self._best_count([probs[i] for i in ranked[:cap]])
        if best == 0 and cap > 0:
            best = self._probe(best, cap)
        else:
            self._plain_steps = 0
        return sorted(ranked[:best])

    def room(self, neighbours: int, n: int) -> int:
        """How many of n nodes a request may verify beside `neighbours` other requests' rows in the
        same forward: all n alone, else as many as keep that forward within this request's share
        of `NEIGHBOUR_SLOWDOWN` over its plain cost (1 / (neighbours + 1) of it: every request may
        take its share in the same forward). 0 means a draft would be cut to nothing, so none should
        be asked for."""
        if neighbours <= 0 or self.fixed is not None:
            return n
        base = neighbours + 1
        share = NEIGHBOUR_SLOWDOWN / base  # each of the forward's requests may take its share at once
        return max(0, min(n, self.costs.row_budget(base, base + n, share) - base))

    def _best_count(self, probs: Sequence[float], per_node: float = 0.0) -> int:
        """How many of the nodes `probs` (best first) maximise expected tokens per unit of time:
        (1 + sum p) over t(R + 1) / t(1), the step overhead and `per_node` for each node drafted."""
        ratio, overhead = self.costs.ratio, self.overhead
        best, best_rate, gain = 0, 1.0 / (ratio(1) + overhead), 1.0
        for r, p in enumerate(probs, start=1):
            gain += p
            rate = gain / (ratio(r + 1) + overhead + r * per_node)
            if rate > best_rate:
                best, best_rate = r, rate
        return best

    def _probe(self, best: int, cap: int = 4) -> int:
        self._plain_steps += 1
        if self._plain_steps < self._probe_after:
            return best
        self._plain_steps = 0
        self._probe_after = min(self._probe_after * 2, 256)
        return min(PROBE_NODES, cap, self.k_max)

    def observe(self, rows: int, verify_seconds: float, step_seconds: float, offered: Sequence[float],
                accepted: int, paid_drafts: int = 0, drafter: str = "") -> None:  # fmt: skip
        """One verified step: its forward of `rows` rows took `verify_seconds` of `step_seconds`."""
        self.costs.observe(rows, verify_seconds)
        one = self.costs.seconds.get(1, verify_seconds)
        if one > 0:
            extra = max(0.0, step_seconds / one - self.costs.ratio(rows))
            if paid_drafts:
                per = extra / paid_drafts
                self.draft_per_token += self.smoothing * (per - self.draft_per_token)
            else:  # a free drafter's wait is the asking's, not every step's
                wait = (step_seconds - verify_seconds) / one
                if self.asking.asked and wait > 0:
                    self.asking.observe(wait, accepted, self.costs.ratio(rows) - 1.0)
                self.overhead += self.smoothing * (max(0.0, extra - wait) - self.overhead)
        self.depths(drafter).observe(offered, accepted)
        if offered and accepted == len(offered):
            self._probe_after = 4
