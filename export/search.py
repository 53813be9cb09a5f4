"""Chain search: which candidate levels (:mod:`polyspec.export.candidates`), in which order, under the target.

:func:`search_chain` on loaded levels, every run greedy on the grid prompts through the profile's runner:

1. Best draft: every candidate directly under the target (dual) at every draft k of the grid (prompt lookup alone at
   every draft.lookup of the grid); Lemma 3.1 time from measured T (``timing.measure_costs``; prompt lookup: none,
   its list search is the decoder's own work) and measured L_eff, beta.
2. Greedy insertion: from the best draft's chain, try every unused model candidate at every position between two
   adjacent levels (below the last one too, where prompt lookup drafts), at the chain's draft and every mu of the
   search; record Theorem 3.2's conditions and both
   chains' Lemma 3.1 times; take the insertion with the smallest predicted time if it is smaller than the current
   chain's; repeat until none is, or the chain has ``max_levels`` levels.
3. Confirm: the two distinct chains (level lists) with the smallest predicted times, each at its best (draft_k,
   mu), and ar, on all prompts, taking turns prompt by prompt. Decision (:data:`SEARCH_RULE`): the measured-faster
   of the two, unless ar is predicted faster than it or measured at least as fast (then ar).

Runs (each over the grid prompts; cached by configuration): B * K drafts (B candidates, K draft_ks), then per round
U * P * M (U unused model candidates, P = levels - 1 positions, M mus), plus 3 confirm runs over all prompts
(:func:`planned_runs` gives the bound).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from polyspec.chain_spec import DraftSpec
from polyspec.errors import PolyspecError
from polyspec.export.acceptance import LOOKUP, steady_widths
from polyspec.export.candidates import Candidate, fits_head
from polyspec.export.profile import ProfileSettings, Runner, Spec, insertion_inputs
from polyspec.export.results import (
    CandidateInfo,
    ChainPoint,
    ConfirmedChain,
    CostRow,
    InsertionTried,
    PromptInfo,
    Run,
    Search,
    SearchDecision,
)
from polyspec.export.timing import grid_widths, mean_cost, measure_costs
from polyspec.export.verdict import insertion_verdict, predict

SEARCH_RULE = ("greedy: insert the unused model candidate (at the position and mu) with the smallest Lemma 3.1 time "
               "per token while it is smaller than the current chain's; confirm the two distinct chains with the "
               "smallest predicted times and ar on all prompts; choose the measured-faster of the two, unless ar is "
               "predicted faster than it or measured at least as fast (then ar)")


@dataclass
class SearchSettings:
    """How to search: the profile's run and timing settings (its grid's draft_ks; ``mus``: the mu values tried per
    insertion, None: the grid's), the longest chain (target included)."""

    profile: ProfileSettings
    max_levels: int = 4  # the target, two verifiers and a draft: past that no device measured has paid
    mus: tuple[int, ...] | None = None

    @property
    def insertion_mus(self) -> tuple[int, ...]:
        return tuple(self.mus or self.profile.mus)


@dataclass
class _Point:
    """A chain run on the grid prompts and its predicted time (inf: not predictable)."""

    levels: list[Any]  # model levels, top first
    draft: DraftSpec
    mu: int | None
    run: Run
    time: float

    @property
    def names(self) -> list[str]:
        """The run's level names (prompt lookup drafting: "lookup" last)."""
        return list(self.run.levels)

    @property
    def lookup(self) -> bool:
        return self.draft.source == "lookup"


@dataclass
class _Costs:
    """T tables per level, measured as runs need them (model levels at every steady width a run used plus the
    nominal ones; prompt lookup from the draft runs, fixed from then on)."""

    levels: dict[str, Any]
    s: ProfileSettings
    say: Callable[[str], None]
    table: dict[str, list[CostRow]] = field(default_factory=dict)

    def nominal(self) -> set[int]:
        return {1, 2, *(k + 1 for k in self.s.draft_ks), *(m + 1 for m in self.s.mus)}

    def ensure(self, runs: list[Run]) -> None:
        need: dict[str, set[int]] = {}
        for r in runs:
            for nm in (nm for nm in r.levels if nm != LOOKUP):
                have = {c.width for c in self.table.get(nm, [])}
                ws = (set(steady_widths(r, nm)) | (self.nominal() if not have else set())) - have
                if ws:
                    need.setdefault(nm, set()).update(ws)
        self._measure(need)

    def _measure(self, need: dict[str, set[int]]) -> None:
        if not need:
            return
        widths = grid_widths(need)
        self.say("search: timing " + ", ".join(f"{n} {w}" for n, w in widths.items()))
        args = self.levels[next(iter(self.levels))].model.args  # the target's (registered first)
        got = measure_costs({n: self.levels[n] for n in widths}, widths, self.s.kv_length, warmup=self.s.warmup,
                            repeats=self.s.repeats, hidden_size=args.hidden_size, vocab_size=args.vocab_size)
        for n, rows in got.items():
            self.table[n] = sorted(self.table.get(n, []) + rows, key=lambda c: c.width)

    def time(self, run: Run) -> float:
        """Lemma 3.1 time per token of ``run`` (kept on it), inf where an L or T it needs is 0."""
        try:
            run.predicted = predict(run, self.table)
        except (ValueError, PolyspecError):
            return math.inf
        return run.predicted.time_per_token_s


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _chain_point(p: _Point) -> ChainPoint:
    r = p.run
    return ChainPoint(levels=p.names, draft=p.draft.text(), mu=list(r.mu), predicted_time_per_token_s=_finite(p.time),
                      measured_tokens_per_second=r.tokens_per_second, beta=r.beta,
                      L={nm: lv.L for nm, lv in r.per_level.items() if lv.L is not None and nm != r.levels[-1]})


def _drafts(run: Runner, book: _Costs, target: Any, cands: list[Candidate], grid: list[list[int]]) -> list[_Point]:
    """Every candidate directly under the target at every draft k (prompt lookup at every size)."""
    s, todo = book.s, []
    for c in cands:
        if c.kind == "lookup":
            todo += [([target], s.draft(source="lookup", lookup=lk)) for lk in s.lookups]
        else:
            todo += [([target, c.level], s.draft(k=k)) for k in s.draft_ks]
    runs = [(levels, d, run(levels, d, None, grid, f"draft {levels[-1].name if d.source == 'model' else LOOKUP} "
                                                    f"{d.text(False)}")) for levels, d in todo]
    book.ensure([r for *_, r in runs])
    return [_Point(levels, d, None, r, book.time(r)) for levels, d, r in runs]


def _cost(book: _Costs, r: Run, nm: str) -> float:
    return 0.0 if nm == LOOKUP else mean_cost(book.table[nm], steady_widths(r, nm))


def _verdict(book: _Costs, cur: _Point, c: Candidate, j: int, r: Run, mu: int) -> Any:
    """Theorem 3.2 on the insertion of ``c`` at ``j`` (inputs as the profile takes them), None where one is 0."""
    above, below = cur.names[j - 1], cur.names[j]
    try:
        t = {nm: _cost(book, r, nm) for nm in (above, c.name, below)}
        inputs = insertion_inputs((above, c.name, below), t, cur.run, r.per_level[c.name].L_eff, r, cur.draft.depth)
        return insertion_verdict(inputs, level=c.name, above=above, below=below,
                                 label=f"{c.name} {cur.draft.text(False)} mu={mu}", draft=cur.draft.text(), mu=mu)
    except (ValueError, TypeError, KeyError, PolyspecError):
        return None


def _legal(c: Candidate, cur: _Point) -> bool:
    return not c.bottom_only and c.name not in cur.names and fits_head(c.level, cur.levels[-1])


def _round(run: Runner, book: _Costs, cur: _Point, cands: list[Candidate], grid: list[list[int]],
           s: SearchSettings, n: int) -> list[tuple[InsertionTried, _Point]]:
    """Every legal insertion into ``cur`` at every position and mu (round ``n``)."""
    trials = []
    for c in (c for c in cands if _legal(c, cur)):
        for j in range(1, len(cur.levels) + cur.lookup):  # under prompt lookup a new level may verify it too
            levels = cur.levels[:j] + [c.level] + cur.levels[j:]
            for mu in s.insertion_mus:
                label = "<-".join(lv.name for lv in levels) + f" {cur.draft.text(False)} mu={mu}"
                trials.append((c, j, mu, levels, run(levels, cur.draft, mu, grid, label)))
    book.ensure([t[-1] for t in trials])
    out = []
    for c, j, mu, levels, r in trials:
        p = _Point(levels, cur.draft, mu, r, book.time(r))
        out.append((InsertionTried(round=n, before=cur.names, inserted=c.name, position=j, draft=cur.draft.text(),
                                   mu=mu,
                                   time_before_s=_finite(cur.time), time_after_s=_finite(p.time),
                                   pays=p.time < cur.time, verdict=_verdict(book, cur, c, j, r, mu),
                                   measured_tokens_per_second_before=cur.run.tokens_per_second,
                                   measured_tokens_per_second_after=r.tokens_per_second), p))
    return out


def _greedy(run: Runner, book: _Costs, start: _Point, cands: list[Candidate], grid: list[list[int]],
            s: SearchSettings) -> tuple[_Point, list[InsertionTried], list[_Point], str]:
    """Insert while the best insertion lowers the predicted time (see the module docstring)."""
    cur, tried, points, n = start, [], [], 0
    while len(cur.names) < s.max_levels:
        n += 1
        trials = _round(run, book, cur, cands, grid, s, n)
        tried += [t for t, _ in trials]
        points += [p for _, p in trials]
        best = min((p for _, p in trials), key=lambda p: p.time, default=None)
        if best is None:
            return cur, tried, points, "no candidate left to insert"
        if not best.time < cur.time:
            return cur, tried, points, "no insertion lowers the predicted time"
        cur = best
    return cur, tried, points, f"the chain has max_levels = {s.max_levels} levels"


def _top_two(points: list[_Point]) -> list[_Point]:
    """The two distinct level lists with the smallest predicted times, each at its best point (predicted order)."""
    best: dict[tuple[str, ...], _Point] = {}
    for p in sorted((p for p in points if math.isfinite(p.time)), key=lambda p: p.time):
        best.setdefault(tuple(p.names), p)
    return list(best.values())[:2]


def _confirm(run: Runner, book: _Costs, top: list[_Point],
             prompts: list[list[int]]) -> tuple[list[ConfirmedChain], ConfirmedChain]:
    """``top`` and ar on all prompts (taking turns prompt by prompt), predicted and measured."""
    target = top[0].levels[0]
    specs = [Spec([target], None, None, "confirm ar")]
    specs += [Spec(p.levels, p.draft, p.mu, "confirm " + "<-".join(p.names)) for p in top]
    ar, *runs = run.many(specs, prompts)
    book.ensure([ar, *runs])

    def confirmed(r: Run, grid_time: float) -> ConfirmedChain:
        t = book.time(r)
        draft = DraftSpec.model_validate(r.draft).text() if r.draft is not None else None
        return ConfirmedChain(levels=list(r.levels), mode=r.mode, draft=draft, mu=list(r.mu),
                              predicted_grid_s=_finite(grid_time), predicted_s=_finite(t),
                              predicted_tokens_per_second=1.0 / t if 0 < t < math.inf else None,
                              tokens_per_second=r.tokens_per_second,
                              tokens_per_second_steady=r.tokens_per_second_steady,
                              lossless_greedy=r.outputs == ar.outputs)

    return [confirmed(r, p.time) for r, p in zip(runs, top, strict=True)], confirmed(ar, book.time(ar))


def decide_search(confirmed: list[ConfirmedChain], ar: ConfirmedChain) -> SearchDecision:
    """:data:`SEARCH_RULE` on the confirmed chains (predicted order) and ar; ties go to the earlier chain."""
    best = max(confirmed, key=lambda c: c.tokens_per_second)
    pred = best.predicted_s if best.predicted_s is not None else math.inf
    ar_pred = ar.predicted_s is not None and ar.predicted_s < pred
    ar_meas = ar.tokens_per_second >= best.tokens_per_second
    pick = ar if ar_pred or ar_meas else best
    return SearchDecision(mode=pick.mode, levels=list(pick.levels), draft=pick.draft, mu=list(pick.mu),
                          ar_predicted_faster=ar_pred, ar_measured_faster=ar_meas, rule=SEARCH_RULE)


def planned_runs(n_bottom: int, n_model: int, n_ks: int, n_mus: int, max_levels: int) -> int:
    """An upper bound on the runs of a search: drafts, every round's insertions (the best draft a model candidate
    or not: at most ``n_model`` unused in the first round), and the 3 confirm runs."""
    rounds = sum(max(n_model - r, 0) * (r + 1) * n_mus for r in range(max(max_levels - 2, 0)))
    return n_bottom * n_ks + rounds + 3


def search_chain(target: Any, cands: list[Candidate], prompts: list[list[int]], s: SearchSettings, *,
                 say: Callable[[str], None] | None = None) -> Search:
    """Search the chain under ``target`` (a loaded ModelLevel) over ``cands`` (see the module docstring)."""
    if not cands:
        raise PolyspecError("the chain search needs at least one candidate level under the target")
    if s.max_levels < 2:
        raise PolyspecError(f"search max_levels must be >= 2 (the target and a draft), got {s.max_levels}")
    t0, say = time.perf_counter(), say or (lambda _m: None)
    run = Runner(s.profile, say)
    book = _Costs({target.name: target, **{c.name: c.level for c in cands if c.level is not None}},
                  replace(s.profile, mus=s.insertion_mus), say)
    grid = prompts[: s.profile.grid_prompts or len(prompts)]
    drafts = _drafts(run, book, target, cands, grid)
    start = min(drafts, key=lambda p: p.time)
    chain, tried, points, why = _greedy(run, book, start, cands, grid, s)
    confirmed, ar = _confirm(run, book, _top_two(drafts + points) or [start], prompts)
    settings = {"draft_ks": list(s.profile.draft_ks), "mus": list(s.insertion_mus), "max_levels": s.max_levels,
                "max_new_tokens": s.profile.max_new_tokens, "kv_length": s.profile.kv_length,
                "warmup": s.profile.warmup, "repeats": s.profile.repeats, "rule": SEARCH_RULE}
    return Search(candidates=[CandidateInfo(c.name, c.kind, c.bottom_only, c.note, c.group_size) for c in cands],
                  settings=settings,
                  prompts=PromptInfo(count=len(prompts), grid_count=len(grid), max_new_tokens=s.profile.max_new_tokens,
                                     lengths=[len(x) for x in prompts]),
                  drafts=[_chain_point(p) for p in drafts], insertions=tried, greedy_chain=_chain_point(chain),
                  stop_reason=why, confirmed=confirmed, ar=ar, decision=decide_search(confirmed, ar),
                  costs=book.table, runs=len(run.done), seconds=time.perf_counter() - t0)
