"""Re-check a request's audit record against the target model: a proof after the fact that
the served output followed the Leviathan/Chen rule, step by step.

What is checked, for a request's `RequestOpened`, its `StepEvent`s and its summary:
- the record is complete and chained: steps 0, 1, 2, ... with none missing; each step's
  context is the prompt plus everything emitted before it;
- the structure of every step: decisions cover drafted[0..m) in order, all kept but the
  last, and the emitted tokens are the kept drafts plus exactly one correction or bonus;
- q(x) of every decision, recomputed by one forward of the target over the prompt and
  the emitted tokens (the rows the verifier saw are all on that path: a rejected
  draft's row is conditioned only on kept tokens), within a tolerance because a batched
  forward and a prefill differ by round-off (~1e-5); the logit bias and penalties are
  applied to each row with the history it conditions on (`controls`), as the verifier did;
- p(x): exactly 1 for deterministic drafters (n-gram, suffix, and any drafter under
  greedy); for the sampling `model` drafter it is recomputed with the draft model the
  same way, when that model is available (otherwise the step is reported unchecked);
- every decision follows the rule: a deterministic drafter's draft is kept iff the target's
  own sample at its position (inverse-CDF on the recomputed row with the recorded u) is the
  draft, and the first sample that is not is the replacement; a sampling drafter's draft is
  kept iff u * p(x) < q(x) (u drawn only when the outcome was uncertain);
- every correction and bonus token is the one inverse-CDF sampling with the recorded u
  gives from the recomputed target row (after a sampling drafter's rejection: the residual
  norm(max(0, q - p))); greedy: the argmax. A draw within round-off of a bucket edge passes;
- every recorded u is the number keyed by (seed, position, purpose) (`decoding.noise`):
  nobody chose the uniforms after the fact;
- the served tokens equal the emitted tokens cut where the output stream (EOS, stop
  strings, max_tokens) ends them, and the summary's totals match the steps.

What cannot be checked: that the model file is the one that served (a different model
fails the q checks, which is the practical test); differences smaller than the
tolerances (a q moved by less than 1e-4 + 0.1% of itself passes); drafted tokens themselves
(any draft is allowed: the rule makes the output exact whatever the drafter says); that
the seed was not chosen for its outcome (the keyed-number check proves the u's were not edited
after the fact, given the recorded seed). Which steps carry draft-model rows is read from
the step's drafter label under sampling: a kind that samples (`drafters.kinds.samples`, the
`model` drafter today); any other drafter must have p(x) = 1.
Round-off can, in rare cases, make an honest record fail: a token whose logit sits within
round-off of the top-k or top-p cut-off is in the filtered row on one side and not on the
other. Greedy near ties and draws at bucket edges are tolerated; that case is not.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from pipeline.audit.grammar import GrammarReplay, format_problem, replay_matcher
from pipeline.decoding.acceptance import Decision, residual
from pipeline.decoding.controls import chain_paths, shaped_logits, uses_context
from pipeline.decoding.drafters.kinds import samples
from pipeline.decoding.noise import ACCEPT, RESIDUAL, SAMPLE, uniform
from pipeline.decoding.output import OutputStream
from pipeline.decoding.sampling import SamplingParams, target_probs
from pipeline.decoding.tree import check
from pipeline.model import Runtime
from pipeline.model.tokenizer import Tokenizer
from pipeline.protocol.messages import AuditEvent, RequestOpened, SpeculativeEvent, StepEvent

Q_ABS, Q_REL = 1e-4, 1e-3  # |recorded - recomputed| <= Q_ABS + Q_REL * max(both), for p and q
LOGIT_TIE = 1e-3  # greedy: logits this close to the maximum count as a tie (either token is right)
DRAW_EPS = 1e-4  # a draw within this fraction of the total mass of a bucket edge may land either side


class StepVerdict(msgspec.Struct):
    step: int
    drafter: str
    drafted: int
    accepted: int
    emitted: list[int]
    problems: list[str] = []  # each one a reason the step does not follow the rule
    unchecked: list[str] = []  # what could not be re-checked (e.g. no draft model)

    @property
    def ok(self) -> bool:
        return not self.problems


class Report(msgspec.Struct):
    request_id: str
    verdict: str  # "pass" | "fail" | "incomplete" (nothing failed, something could not be checked)
    steps: list[StepVerdict]
    problems: list[str]  # request-level: missing events, summary, served output
    unchecked: list[str]
    max_q_error: float  # largest |recorded - recomputed| q(x) seen: how close round-off came
    max_p_error: float

    @property
    def failed_steps(self) -> list[int]:
        return [s.step for s in self.steps if not s.ok]


# --- pure checks on numbers -------------------------------------------------------------


def close(recorded: float, recomputed: float) -> bool:
    return abs(recorded - recomputed) <= Q_ABS + Q_REL * max(abs(recorded), abs(recomputed))


def rule_problem(d: Decision) -> str | None:
    """Does the decision follow the rule on its own recorded p, q and u?"""
    if d.u is None:
        if d.q >= d.p and not d.kept:
            return f"q(x)={d.q:.6g} >= p(x)={d.p:.6g} must keep the draft without a draw, but it was rejected"
        if d.q == 0.0 and d.kept:
            return "q(x)=0 must reject the draft, but it was kept"
        if 0.0 < d.q < d.p:
            return f"q(x)={d.q:.6g} < p(x)={d.p:.6g} needs a uniform draw, but none is recorded"
        return None
    if d.q >= d.p or d.q == 0.0:
        return f"a uniform draw is recorded although the outcome was certain (p={d.p:.6g}, q={d.q:.6g})"
    if not 0.0 <= d.u < 1.0:
        return f"u={d.u!r} is not in [0, 1)"
    if d.kept != (d.u * d.p < d.q):
        want = "kept" if d.u * d.p < d.q else "rejected"
        return f"u={d.u:.6g}, p={d.p:.6g}, q={d.q:.6g}: the rule says {want}, the record says the opposite"
    return None


def draw_problem(dist: np.ndarray, u: float | None, token: int) -> str | None:
    """Is `token` what inverse-CDF sampling (`sampling.draw`) gives from `dist` with `u`?"""
    support = np.flatnonzero(dist)
    if u is None:
        if support.size == 1 and support[0] == token:
            return None
        share = dist[token] / dist.sum() if dist.sum() > 0 else 0.0
        if share >= 1.0 - DRAW_EPS:  # round-off left specks of mass elsewhere
            return None
        return f"token {token} was emitted without a draw, but the distribution has {support.size} tokens"
    if not 0.0 <= u < 1.0:
        return f"u={u!r} is not in [0, 1)"
    if dist[token] <= 0.0:
        return f"token {token} has probability 0 here; it cannot be drawn"
    cdf = np.cumsum(dist)
    total = cdf[-1]
    x, lo, hi = u * total, cdf[token] - dist[token], cdf[token]
    if lo - DRAW_EPS * total <= x < hi + DRAW_EPS * total:
        return None
    drawn = int(np.searchsorted(cdf, x, side="right"))
    drawn = drawn if drawn < dist.size else int(support[-1])
    return f"u={u:.6g} draws token {drawn}, but token {token} was emitted"


def greedy_problem(logits: np.ndarray, token: int, what: str) -> str | None:
    """Greedy emits the argmax; a near tie (round-off) may go either way."""
    best = int(np.argmax(logits))
    if token == best or logits[token] >= logits[best] - LOGIT_TIE:
        return None
    gap = f"logit {logits[token]:.4f} < {logits[best]:.4f}"
    return f"{what} token {token} is not the target's argmax {best} ({gap})"


def greedy_q_problem(logits: np.ndarray, token: int, q: float) -> str | None:
    """Greedy q is one-hot: 1 for the argmax, 0 elsewhere; a near tie may be recorded either way."""
    best = int(np.argmax(logits))
    want = 1.0 if token == best else 0.0
    if q == want or (q in (0.0, 1.0) and logits[token] >= logits[best] - LOGIT_TIE):
        return None
    return f"recorded q(x)={q:.6g}, the target's greedy row gives {want:g} (argmax {best})"


def keyed_numbers(step: StepEvent, first: int, sampling_drafter: bool) -> list[tuple[float, int, int]]:
    """Each recorded u of a step with the (position, purpose) its number is keyed by; `first` is
    the position the step's first emitted token sits at."""
    numbers = [
        (d.u, first + i, ACCEPT if sampling_drafter else SAMPLE)
        for i, d in enumerate(step.decisions)
        if d.u is not None
    ]
    if step.final_u is not None:
        rejected = bool(step.decisions) and not step.decisions[-1].kept
        purpose = RESIDUAL if rejected and sampling_drafter else SAMPLE
        numbers.append((step.final_u, first + len(step.emitted) - 1, purpose))
    return numbers


# --- rows of a model along the served sequence -----------------------------------------


class RowSource:
    """A model's logits along one token sequence, fed forward in chunks as positions are asked
    for (in non-decreasing order), so memory stays bounded on long outputs."""

    def __init__(self, model: Runtime, tokens: Sequence[int], chunk: int = 64) -> None:
        self.model, self.tokens, self.chunk = model, list(tokens), chunk
        self.cache = model.new_cache(capacity=max(len(self.tokens), 1))
        self.start = 0  # position of buf[0]
        self.buf = np.empty((0, model.cfg.vocab_size), np.float32)

    def rows(self, first: int, last: int) -> np.ndarray:
        """Logits at positions first..last (position i predicts token i + 1)."""
        if first < self.start or last >= len(self.tokens):
            raise IndexError(f"rows {first}..{last} are not reachable from position {self.start}")
        while self.start + len(self.buf) <= last:
            fed = self.cache.length
            block = self.tokens[fed : fed + self.chunk]
            self.buf = np.concatenate([self.buf, self.model.forward(self.cache, block)])
        drop = first - self.start
        self.buf, self.start = self.buf[drop:], first
        return self.buf[: last - first + 1]


# --- the whole request -------------------------------------------------------------------


class Record(msgspec.Struct):
    request_id: str
    opened: RequestOpened | None
    steps: list[StepEvent]
    summary: SpeculativeEvent | None


def collect(request_id: str, events: Sequence[AuditEvent]) -> Record:
    steps = sorted((e for e in events if isinstance(e, StepEvent)), key=lambda e: e.step)
    opened = next((e for e in events if isinstance(e, RequestOpened)), None)
    summary = next((e for e in events if isinstance(e, SpeculativeEvent)), None)
    return Record(request_id, opened, steps, summary)


def uses_draft_rows(step: StepEvent, params: SamplingParams) -> bool:
    """Only a sampling drafter's drafts (`kinds.samples`), and only when the request samples: then
    p is a row."""
    return samples(step.drafter) and not params.greedy and bool(step.drafted)


def tree_structure_problems(step: StepEvent) -> list[str]:
    """A token tree's step: a well-formed tree; decision i keeps a child of the node kept at depth
    i - 1 (the root first) or, last, rejects that node's first child for a token none of its
    children carries; a kept leaf ends the decisions; emitted is the kept path plus one token."""
    parents, drafted = step.parents or [], step.drafted
    if (problem := check(drafted, parents)) is not None:
        return [problem]
    if len(drafted) > step.k:
        return [f"{len(drafted)} draft nodes for k={step.k}"]
    problems, node = [], -1
    for i, d in enumerate(step.decisions):
        below = [c for c, parent in enumerate(parents) if parent == node]
        carrying = next(
            (c for c in below if drafted[c] == (d.draft_token if d.kept else d.replacement)), None
        )
        if not below:
            return [*problems, f"decision {i} is below a leaf"]
        if d.position != i or (not d.kept and d.draft_token != drafted[below[0]]):
            problems.append(f"decision {i} is for position {d.position}, token {d.draft_token}")
        if d.kept and carrying is None:
            return [*problems, f"decision {i} keeps {d.draft_token}, which no child of the kept path carries"]
        if not d.kept and (carrying is not None or i != len(step.decisions) - 1):
            problems.append(
                f"decision {i} rejects, yet a child carries {d.replacement} or later ones were decided"
            )
        node = carrying if d.kept else node
    accepted = sum(d.kept for d in step.decisions)
    kept = [d.draft_token for d in step.decisions if d.kept]
    if (not step.decisions or step.decisions[-1].kept) and any(parent == node for parent in parents):
        problems.append("the kept path ends on a node with children, yet nothing rejected them")
    if len(step.emitted) != accepted + 1 or step.emitted[:accepted] != kept:
        problems.append(f"emitted {step.emitted} is not the {accepted} kept nodes plus one token")
    elif (
        step.decisions and not step.decisions[-1].kept and step.decisions[-1].replacement != step.emitted[-1]
    ):
        problems.append(f"replacement {step.decisions[-1].replacement} is not the emitted {step.emitted[-1]}")
    return problems


def structure_problems(step: StepEvent) -> list[str]:
    """Decisions cover a prefix of the drafts, all kept but possibly the last; emitted follows."""
    if step.parents is not None:
        return tree_structure_problems(step)
    problems: list[str] = []
    drafted, decisions = step.drafted, step.decisions
    if len(drafted) > step.k:
        problems.append(f"{len(drafted)} drafts for k={step.k}")
    if bool(drafted) != bool(decisions) or len(decisions) > len(drafted):
        return [*problems, f"{len(decisions)} decisions for {len(drafted)} drafts"]
    for i, d in enumerate(decisions):
        if d.position != i or d.draft_token != drafted[i]:
            problems.append(f"decision {i} is for position {d.position}, token {d.draft_token}")
        if not d.kept and i != len(decisions) - 1:
            problems.append(f"decision {i} rejects, yet later drafts were decided")
        if d.kept and d.replacement is not None:
            problems.append(f"decision {i} keeps its draft but names a replacement")
    rejected = bool(decisions) and not decisions[-1].kept
    if not rejected and len(decisions) != len(drafted):
        problems.append(f"all {len(decisions)} decisions kept, but {len(drafted)} tokens were drafted")
    accepted = sum(d.kept for d in decisions)
    if len(step.emitted) != accepted + 1 or step.emitted[:accepted] != drafted[:accepted]:
        problems.append(f"emitted {step.emitted} is not the {accepted} kept drafts plus one token")
    elif rejected and decisions[-1].replacement != step.emitted[-1]:
        problems.append(f"replacement {decisions[-1].replacement} is not the emitted {step.emitted[-1]}")
    return problems


class Verifier:
    """Walks one request's steps in order against the target's (and draft's) recomputed rows."""

    def __init__(self, record: Record, target: Runtime, draft: Runtime | None) -> None:
        assert record.opened is not None
        self.record, self.opened = record, record.opened
        self.params = msgspec.convert(self.opened.settings["params"], SamplingParams)
        self.seed = int(self.opened.settings["seed"])
        self.vocab = target.cfg.vocab_size
        sequence = [*self.opened.prompt_tokens, *(t for s in record.steps for t in s.emitted)]
        sequence = [t if 0 <= t < self.vocab else 0 for t in sequence]  # bad ids stop `run` at their step
        self.sequence = sequence
        self.target_rows = RowSource(target, sequence)
        self.draft_rows = (
            None if draft is None else self.target_rows if draft is target else RowSource(draft, sequence)
        )
        self.max_q_error = self.max_p_error = 0.0
        matcher = replay_matcher(target, self.params.response_format)  # checked by `settings_problem`
        self.grammar = None if matcher is None else GrammarReplay(matcher)

    def run(self) -> list[StepVerdict]:
        verdicts: list[StepVerdict] = []
        position = len(self.opened.prompt_tokens) - 1  # the row that decides the step's first token
        for expected, step in enumerate(self.record.steps):
            accepted = sum(d.kept for d in step.decisions)
            if step.step != expected:  # the verdict names the missing step, not the one found next
                problem = f"step {expected} is missing from the record (found step {step.step} next)"
                verdicts.append(StepVerdict(expected, "", 0, 0, [], problems=[problem]))
                break  # positions no longer line up: nothing after can be trusted
            verdict = StepVerdict(step.step, step.drafter, len(step.drafted), accepted, step.emitted)
            verdicts.append(verdict)
            if any(not 0 <= t < self.vocab for t in [*step.drafted, *step.emitted]):
                verdict.problems.append(f"a token id outside the model's vocabulary [0, {self.vocab})")
                break  # the target cannot be run past it
            verdict.problems += structure_problems(step) if expected else self.first_step_shape(step)
            if self.grammar is not None and not verdict.problems:
                verdict.problems += [p for p in [self.grammar.start(step.emitted[:accepted])] if p]
            if not verdict.problems:
                self.check_numbers(step, position, verdict)
            if self.grammar is not None and (problem := self.grammar.finish(step.emitted)) is not None:
                verdict.problems.append(problem)
                break  # the grammar's state is lost: later masks cannot be derived
            sampling_drafter = uses_draft_rows(step, self.params)
            for got, at, purpose in keyed_numbers(step, position + 1, sampling_drafter):
                if got != (want := uniform(self.seed, at, purpose)):
                    verdict.problems.append(
                        f"u={got!r} at position {at}, but the number the seed gives there is {want!r}"
                    )
            position += len(step.emitted)
        return verdicts

    @staticmethod
    def first_step_shape(step: StepEvent) -> list[str]:
        if step.drafted or step.decisions or len(step.emitted) != 1:
            return [f"the prefill step must emit one token and decide nothing, got emitted {step.emitted}"]
        return []

    def check_numbers(self, step: StepEvent, position: int, verdict: StepVerdict) -> None:
        """q and p against recomputed rows, the rule on recorded numbers, and the final draw."""
        params, decisions = self.params, step.decisions
        accepted = verdict.accepted
        logits = self.target_rows.rows(position, position + accepted)
        logits = self.shaped(logits if self.grammar is None else self.grammar.target(logits), position, step)
        q_rows = target_probs(logits, params)
        p_rows: np.ndarray | None = None
        if uses_draft_rows(step, params):
            if self.draft_rows is None:
                verdict.unchecked.append("p(x) and the residual: the draft model is not available")
            else:
                draft_logits = self.draft_rows.rows(position, position + accepted)
                p_rows = target_probs(self.shaped(draft_logits, position, step), params)
                p_rows = p_rows if self.grammar is None else self.grammar.draft(p_rows, step.drafted)
        for i, d in enumerate(decisions):
            where = f"position {i} (draft {d.draft_token})"
            if params.greedy:
                if (problem := greedy_q_problem(logits[i], d.draft_token, d.q)) is not None:
                    verdict.problems.append(f"{where}: {problem}")
            else:
                q = float(q_rows[i][d.draft_token])
                self.max_q_error = max(self.max_q_error, abs(q - d.q))
                if not close(d.q, q):
                    verdict.problems.append(f"{where}: recorded q(x)={d.q:.6g}, the target gives {q:.6g}")
            if uses_draft_rows(step, params):
                if p_rows is not None:
                    p = float(p_rows[i][d.draft_token])
                    self.max_p_error = max(self.max_p_error, abs(p - d.p))
                    if not close(d.p, p):
                        verdict.problems.append(f"{where}: recorded p(x)={d.p:.6g}, the draft gives {p:.6g}")
            elif d.p != 1.0:
                verdict.problems.append(f"{where}: a deterministic drafter has p(x)=1, recorded {d.p:.6g}")
            if uses_draft_rows(step, params) or params.greedy:
                problem = rule_problem(d)
            else:  # the target's own sample at this position decided: kept iff it is the draft
                problem = draw_problem(q_rows[i], d.u, d.draft_token if d.kept else d.replacement or 0)
                if problem is None and not d.kept and d.replacement == d.draft_token:
                    problem = "the target's sample is the draft itself, yet it was rejected"
            if problem is not None:
                verdict.problems.append(f"{where}: {problem}")
        self.check_final(step, logits, q_rows, p_rows, verdict)

    def shaped(self, logits: np.ndarray, position: int, step: StepEvent) -> np.ndarray:
        """A step's rows with the logit bias and penalties: the row at `position` follows the
        sequence up to it, each later row also the kept drafts before it."""
        if not uses_context(self.params):
            return logits
        context, kept = self.sequence[: position + 1], step.emitted[: len(logits) - 1]
        return shaped_logits(logits, self.params, context, len(self.opened.prompt_tokens), chain_paths(kept))

    def check_final(
        self,
        step: StepEvent,
        logits: np.ndarray,
        q_rows: np.ndarray,
        p_rows: np.ndarray | None,
        verdict: StepVerdict,
    ) -> None:
        token, decisions, accepted = step.emitted[-1], step.decisions, verdict.accepted
        rejected = bool(decisions) and not decisions[-1].kept
        what = "replacement" if rejected else ("first" if step.step == 0 else "bonus")
        if self.params.greedy:
            problem = greedy_problem(logits[accepted], token, what)
            if problem is None and step.final_u is not None:
                problem = f"greedy needs no draw, but u={step.final_u!r} is recorded for the {what} token"
        elif rejected and uses_draft_rows(step, self.params):
            if p_rows is None:
                return  # reported unchecked: the residual needs the draft row
            dist = residual(q_rows[accepted], p_rows[accepted], decisions[-1].draft_token)
            problem = draw_problem(dist, step.final_u, token)
        else:
            problem = draw_problem(q_rows[accepted], step.final_u, token)
        if problem is not None:
            verdict.problems.append(f"{what} token: {problem}")


def served_problems(record: Record, tokenizer: Tokenizer) -> list[str]:
    """The served tokens are the emitted ones cut by the output stream; totals match the steps."""
    summary, opened = record.summary, record.opened
    assert summary is not None and opened is not None
    problems: list[str] = []
    steps = record.steps[1:]
    drafted = sum(len(s.drafted) for s in steps)
    accepted = sum(sum(d.kept for d in s.decisions) for s in steps)
    if (summary.drafted, summary.accepted, summary.iterations) != (drafted, accepted, len(steps)):
        problems.append(
            f"summary says {summary.drafted} drafted, {summary.accepted} accepted in {summary.iterations} "
            f"steps; the steps say {drafted}, {accepted} in {len(steps)}"
        )
    params = msgspec.convert(opened.settings["params"], SamplingParams)
    out = OutputStream(tokenizer, params)
    for token in (t for s in record.steps for t in s.emitted):
        out.push(token)
        if out.done:
            break
    if summary.tokens != out.tokens:
        problems.append(f"served {len(summary.tokens)} tokens that differ from the {len(out.tokens)} decided")
    if out.done and summary.finish_reason not in (out.finish_reason, "cancelled"):
        problems.append(
            f"finish reason {summary.finish_reason!r}, the output stream says {out.finish_reason!r}"
        )
    if not out.done and summary.finish_reason == "stop":
        problems.append("finish reason 'stop', but no stop condition occurs in the decided tokens")
    return problems


def settings_problem(opened: RequestOpened, target: Runtime) -> str | None:
    try:
        params = msgspec.convert(opened.settings["params"], SamplingParams)
        int(opened.settings["seed"])
    except (KeyError, TypeError, ValueError, msgspec.ValidationError) as exc:
        return f"the recorded settings are unusable: {exc!r}"
    if (problem := format_problem(target, params.response_format)) is not None:
        return problem
    prompt = opened.prompt_tokens
    if not prompt or any(not 0 <= t < target.cfg.vocab_size for t in prompt):
        return "the recorded prompt is empty or has token ids outside the model's vocabulary"
    return None


def verify_request(
    request_id: str, events: Sequence[AuditEvent], target: Runtime, draft: Runtime | None = None
) -> Report:
    """Check one request's events against the target (and the draft model, if it sampled)."""
    record = collect(request_id, events)
    problems: list[str] = []
    unchecked: list[str] = []
    steps: list[StepVerdict] = []
    verifier = None
    if record.opened is None:
        problems.append("no RequestOpened event: the settings and prompt are not recorded")
    elif (problem := settings_problem(record.opened, target)) is not None:
        problems.append(problem)
    elif not record.steps:
        problems.append("no steps recorded")
    else:
        verifier = Verifier(record, target, draft)
        steps = verifier.run()
        last = record.steps[-1].step
        if (
            record.summary is not None
            and record.summary.iterations > last
            and not any(s.problems for s in steps)
        ):
            missing = f"step {last + 1}" + (
                f"..{record.summary.iterations}" if record.summary.iterations > last + 1 else ""
            )
            problems.append(
                f"{missing} missing from the record: the summary counts {record.summary.iterations} steps"
            )
        if record.summary is None:
            unchecked.append("the served output: no summary (the request failed or is still running)")
        elif not record.summary.tokens:
            unchecked.append("the served output: this record predates served tokens in the summary")
        elif not any(s.problems for s in steps):
            assert target.tokenizer is not None
            problems += served_problems(record, target.tokenizer)
    unchecked += [f"step {s.step}: {item}" for s in steps for item in s.unchecked]
    failed = problems or any(s.problems for s in steps)
    return Report(
        request_id=request_id,
        verdict="fail" if failed else "incomplete" if unchecked else "pass",
        steps=steps,
        problems=problems,
        unchecked=unchecked,
        max_q_error=verifier.max_q_error if verifier else 0.0,
        max_p_error=verifier.max_p_error if verifier else 0.0,
    )
