"""Choosing k, the number of draft tokens to verify, from measured costs and acceptance.

With per-token acceptance probability a, a step that verifies k drafts emits on average
E(k) = 1 + a + ... + a^k tokens and costs verify(k + 1) + k * draft, both measured in
units of a one-token step. The controller picks the k with the best expected tokens
per unit of time; k = 0 is plain decoding, chosen when no k pays. While at k = 0 it
probes now and then (with exponential back-off) so it notices when drafts start paying.
Costs and acceptance are EWMAs of what the request actually measured, starting from
priors: the runtime's verify cost is flat from 2 to 8 rows (`kernels.ROW_BUCKETS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

K_LIMIT = 32


def expected_tokens(acceptance: float, k: int) -> float:
    return float(sum(acceptance**i for i in range(k + 1)))


def prior_verify_ratio(rows: int) -> float:
    """Cost of a `rows`-token forward over a one-token forward before anything is measured."""
    return 1.0 if rows <= 1 else 2.0 if rows <= 8 else 2.0 + 0.09 * (rows - 8)


@dataclass
class CostModel:
    smoothing: float = 0.2
    verify_seconds: dict[int, float] = field(default_factory=dict)
    draft_seconds_per_token: float = 0.0

    def observe_verify(self, rows: int, seconds: float) -> None:
        old = self.verify_seconds.get(rows)
        self.verify_seconds[rows] = seconds if old is None else old + self.smoothing * (seconds - old)

    def observe_draft(self, tokens: int, seconds: float) -> None:
        if tokens:
            per_token = seconds / tokens
            self.draft_seconds_per_token += self.smoothing * (per_token - self.draft_seconds_per_token)

    def step_cost(self, k: int) -> float:
        """Cost of a step with k drafts, in one-token-forward units."""
        one = self.verify_seconds.get(1)
        rows = k + 1
        if one and rows in self.verify_seconds:
            verify = self.verify_seconds[rows] / one
        else:
            verify = prior_verify_ratio(rows)
        draft = self.draft_seconds_per_token / one if one else 0.0
        return verify + k * draft


@dataclass
class KController:
    """Fixed k when `fixed` is set; otherwise the cost-model choice described above. Its inputs
    come from a `Speculation`, which holds them to 0..K_LIMIT (k) and 1..K_LIMIT (k_max)."""

    fixed: int | None = None
    k_max: int = 16
    acceptance: float = 0.6  # prior per-token acceptance
    smoothing: float = 0.25
    costs: CostModel = field(default_factory=CostModel)
    _plain_steps: int = 0
    _probe_after: int = 4

    def best_k(self) -> int:
        rates = [expected_tokens(self.acceptance, k) / self.costs.step_cost(k) for k in range(self.k_max + 1)]
        return max(range(len(rates)), key=rates.__getitem__)

    def choose(self) -> int:
        if self.fixed is not None:
            return self.fixed
        k = self.best_k()
        if k > 0:
            return k
        self._plain_steps += 1
        if self._plain_steps < self._probe_after:
            return 0
        # Probe: try a short draft so a changed acceptance can be noticed.
        self._plain_steps = 0
        self._probe_after = min(self._probe_after * 2, 256)
        return min(4, self.k_max)

    def observe(self, drafted: int, accepted: int) -> None:
        """Update per-token acceptance from one step: `accepted` successes, then one failure if any."""
        if drafted == 0:
            return
        failures = 1 if accepted < drafted else 0
        step_rate = accepted / (accepted + failures)
        self.acceptance += self.smoothing * (step_rate - self.acceptance)
        if accepted == drafted:
            self._probe_after = 4
