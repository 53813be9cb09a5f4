"""Profiling an n-level chain (target first, draft last) on the device and deciding its settings.

:func:`profile_levels` runs, on already loaded levels:

1. Grid, on the first ``grid_prompts`` prompts: dual (target <- draft) for every draft k, with and without
   prompt-lookup blocks of every size, and the whole chain for every (k, mu); with a draft tree candidate also dual
   and chain (every mu) with the tree; prompt lookup alone under the target at every size; and ar.
2. Costs: T(width) of each level at every forward width the grid used (:mod:`polyspec.export.timing`).
3. Prediction: Lemma 3.1 time per token for every grid point; the chosen configuration minimises it.
4. Final runs on all prompts: ar, the best dual, the chosen chain, dual with the chain's draft and, for every
   intermediate level M_j (each adjacent insertion), the chain without M_j and M_j heading the levels below it.
5. Verdicts per insertion (Theorem 3.2 conditions, exact Lemma 3.1 times), speedups, the variance checks and the
   decision (:mod:`polyspec.export.verdict`).

Names of the final runs: ``ar``, ``dual``, ``chain``, ``dual_at_chain_k``; per insertion the chain without M_j
(``dual_at_chain_k`` when that is the target over the draft, else ``chain_without_<tag>``) and the tail
(``<tag_j>_over_<tag_j+1>...``, e.g. ``int4_over_head``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from polyspec.chain_spec import DraftSpec
from polyspec.errors import PolyspecError
from polyspec.export.acceptance import run_interleaved, steady_widths
from polyspec.export.results import GridRow, Insertion, InsertionInputs, LevelInfo, Profile, PromptInfo, Run
from polyspec.export.timing import grid_widths, mean_cost, measure_costs
from polyspec.export.verdict import (
    choose_config,
    decide,
    grid_row,
    insertion_verdict,
    lengths_from_hist,
    predict,
    runners_up,
    speedup_summary,
    variance_check,
)


@dataclass
class ProfileSettings:
    """How to profile: tokens per prompt, the KV length and repeats of the timings, the grid."""

    max_new_tokens: int
    kv_length: int
    warmup: int = 2
    repeats: int = 10
    draft_ks: tuple[int, ...] = (1, 2, 3, 4, 5)
    mus: tuple[int, ...] = (4, 6, 8, 12)
    grid_prompts: int | None = None  # prompts per grid point (None: all)
    tree: DraftSpec | None = None  # a tree candidate (its shape, its draft.lookup) to weigh against linear drafts
    lookups: tuple[int, ...] = ()  # draft.lookup values tried with every k, and prompt lookup alone at each
    eos_ids: frozenset[int] = frozenset()
    confirm_duals: int = 0  # runner-up duals (predicted; the grid's fastest) the final runs measure; the fastest kept
    vocab: int = 0  # the draft head's vocabulary (draft.vocab) in every configuration

    def draft(self, **kw: Any) -> DraftSpec:
        return DraftSpec(vocab=self.vocab, **kw)


@dataclass
class _Chain:
    """The loaded levels (top first) with their names and short tags."""

    levels: list[Any]
    tags: list[str]

    @property
    def names(self) -> list[str]:
        return [lv.name for lv in self.levels]

    def sub(self, idx: list[int]) -> list[Any]:
        return [self.levels[i] for i in idx]

    def for_draft(self, draft: DraftSpec | None) -> list[Any]:
        """The levels a dual over ``draft`` runs: the target and the bottom level (the target alone under prompt
        lookup alone; ar: the target)."""
        return self.levels[:1] if draft is None or draft.source == "lookup" else [self.levels[0], self.levels[-1]]


class Spec(NamedTuple):
    """One configuration for :meth:`Runner.many`."""

    levels: list[Any]
    draft: DraftSpec | None  # None: ar
    mu: int | None
    tag: str


class Runner:
    """Runs each configuration once (keyed by levels, draft, mu, prompt count) and reports it."""

    def __init__(self, s: ProfileSettings, say: Callable[[str], None]):
        self.s, self.say, self.done = s, say, {}

    def __call__(self, levels: list[Any], draft: DraftSpec | None, mu: int | None, prompts: list[list[int]],
                 tag: str) -> Run:
        return self.many([Spec(levels, draft, mu, tag)], prompts)[0]

    def many(self, specs: list[Spec], prompts: list[list[int]]) -> list[Run]:
        """Each :class:`Spec` over ``prompts``; the ones not run yet take turns prompt by prompt
        (acceptance.run_interleaved), so the comparisons the decision rests on see the same machine."""
        keys = [self._key(sp, len(prompts)) for sp in specs]
        todo = {key: sp for key, sp in zip(keys, specs, strict=True) if key not in self.done}
        t0 = time.perf_counter()
        configs = [dict(levels=sp.levels, draft=sp.draft, label=sp.tag,
                        mu=[sp.mu] * len(sp.levels) if sp.mu is not None else None) for sp in todo.values()]
        runs = run_interleaved(configs, prompts, self.s.max_new_tokens, eos_ids=self.s.eos_ids) if todo else []
        self.done.update(zip(todo, runs, strict=True))
        took = (time.perf_counter() - t0) / max(len(runs), 1)
        for run in runs:
            ls = "/".join(f"{lv.L:.2f}" for lv in run.per_level.values() if lv.L is not None)
            self.say(f"profile: {run.label:<28} L={ls} {run.tokens_per_second:.1f} tok/s ({took:.1f} s)")
        return [self.done[key] for key in keys]

    @staticmethod
    def _key(sp: Spec, n_prompts: int) -> tuple:
        chain = len(sp.levels) > 2 or (len(sp.levels) == 2 and sp.draft is not None and sp.draft.source == "lookup")
        return (tuple(lv.name for lv in sp.levels), sp.draft.text() if sp.draft is not None else None,
                sp.mu if chain else None, n_prompts)


def _grid_runs(run: Runner, ch: _Chain, prompts: list[list[int]], s: ProfileSettings) -> list[Run]:
    """Dual per draft_k (and per prompt-lookup size), the whole chain per (draft_k, mu), the tree variants, prompt
    lookup alone, ar (in this order)."""
    out: list[Run] = []
    linear = [s.draft(k=k) for k in s.draft_ks]
    for d in linear + ([s.tree] if s.tree is not None else []):
        out.append(run(ch.for_draft(d), d, None, prompts, f"grid dual {d.text(False)}"))
        if d.tree is None:
            out += [run(ch.for_draft(d), x, None, prompts, f"grid dual {x.text(False)}")
                    for x in (s.draft(k=d.k, lookup=lk) for lk in s.lookups)]
        out += [run(ch.levels, d, mu, prompts, f"grid chain {d.text(False)} mu={mu}") for mu in s.mus]
    for lk in s.lookups:
        d = s.draft(source="lookup", lookup=lk)
        out.append(run(ch.for_draft(d), d, None, prompts, f"grid dual {d.text(False)}"))
    out.append(run(ch.levels[:1], None, None, prompts, "grid ar"))
    return out


def _nominal_widths(n: int, s: ProfileSettings) -> list[set[int]]:
    """Widths every level is timed at whatever the grid saw: a verifier of the draft draft_k + 1, a verifier of
    blocks mu + 1, the draft 1 and 2."""
    ks, ms = {k + 1 for k in s.draft_ks}, {m + 1 for m in s.mus}
    return [{1, *ks, *ms} if i < n - 2 else ({1, *ks} if i == n - 2 else {1, 2}) for i in range(n)]


def _costs(ch: _Chain, grid: list[Run], s: ProfileSettings, say: Callable[[str], None]) -> dict[str, list]:
    seen = {nm: set(extra) for nm, extra in zip(ch.names, _nominal_widths(len(ch.levels), s), strict=True)}
    for r in grid:
        for nm in r.levels:
            if nm in seen:
                seen[nm] |= set(steady_widths(r, nm))
    widths = grid_widths(seen)
    say(f"profile: timing forwards at kv_length={s.kv_length}: " + ", ".join(f"{n} {w}" for n, w in widths.items()))
    args = ch.levels[0].model.args
    return measure_costs(dict(zip(ch.names, ch.levels, strict=True)), widths, s.kv_length, warmup=s.warmup,
                         repeats=s.repeats, hidden_size=args.hidden_size, vocab_size=args.vocab_size)


@dataclass
class _Choice:
    """The grid's chosen configuration and the draft settings the final runs use."""

    chosen: GridRow
    best_dual: GridRow
    chain_draft: DraftSpec  # the chain-like row's draft (the chosen one's where the chain was chosen)
    mu: int
    other_duals: list[GridRow] = field(default_factory=list)  # runner-ups the final runs measure beside best_dual


def _draft_of(row: GridRow) -> DraftSpec | None:
    return DraftSpec.model_validate(row.draft) if row.draft is not None else None


def _choose(rows: list[GridRow], confirm: int = 0) -> _Choice:
    chosen, best_dual, best_chain = (choose_config(rows, m) for m in (("chain", "dual"), ("dual",), ("chain",)))
    chain_like = best_chain if chosen.mode != "chain" else chosen
    return _Choice(chosen=chosen, best_dual=best_dual, chain_draft=_draft_of(chain_like), mu=chain_like.mu[0],
                   other_duals=runners_up(rows, best_dual, confirm))


def _dual_spec(ch: _Chain, row: GridRow) -> Spec:
    """A final run's spec for the dual of grid row ``row``."""
    d = _draft_of(row)
    return Spec(ch.for_draft(d), d, None, f"dual {d.text(False)}")


def _keep_fastest_dual(c: _Choice, final: dict[str, Run], say: Callable[[str], None]) -> dict[str, Any]:
    """Among the best predicted dual and its runner-ups, measured on every prompt, keep the fastest as ``dual``
    (and as the choice, where the choice was dual); the runner-ups' runs leave ``final``. Returns what was compared."""
    rows = {"dual": c.best_dual, **{f"dual_alt{i}": r for i, r in enumerate(c.other_duals)}}
    measured = {key: final[key].tokens_per_second for key in rows}
    best = max(measured, key=lambda key: measured[key])
    compared = {rows[key].label: round(tps, 2) for key, tps in measured.items()}  # grid labels: runs may be shared
    if best != "dual":
        say(f"profile: {rows[best].label} measured faster than {rows['dual'].label} on every prompt: kept")
        if c.chosen is c.best_dual:
            c.chosen = rows[best]
        c.best_dual = rows[best]
        final["dual"] = final[best]
    for key in rows:
        if key != "dual":
            final.pop(key)
    return {"duals_measured_tokens_per_second": compared, "dual_kept": c.best_dual.label}


def _without(j: int, n: int) -> list[int]:
    return [i for i in range(n) if i != j]


def _run_keys(ch: _Chain, j: int) -> tuple[str, str]:
    """Final-run keys of insertion j: the chain without level j, and level j heading the levels below it."""
    before = "dual_at_chain_k" if len(ch.levels) == 3 else f"chain_without_{ch.tags[j]}"
    return before, "_over_".join(ch.tags[j:])


def _final_runs(run: Runner, ch: _Chain, prompts: list[list[int]], c: _Choice) -> dict[str, Run]:
    """The final runs on all prompts (see the module docstring), interleaved prompt by prompt."""
    n, d, mu = len(ch.levels), c.chain_draft, c.mu
    specs = {"ar": Spec(ch.levels[:1], None, None, "ar"), "dual": _dual_spec(ch, c.best_dual),
             **{f"dual_alt{i}": _dual_spec(ch, r) for i, r in enumerate(c.other_duals)},
             "chain": Spec(ch.levels, d, mu, f"chain {d.text(False)} mu={mu}"),
             "dual_at_chain_k": Spec(ch.for_draft(d), d, None, f"dual {d.text(False)}")}
    for j in range(1, n - 1):
        before, tail = _run_keys(ch, j)
        sub = _without(j, n)
        specs[before] = Spec(ch.sub(sub), d, mu, f"chain without {ch.tags[j]} {d.text(False)}"
                             + (f" mu={mu}" if len(sub) > 2 else ""))
        specs[tail] = Spec(ch.levels[j:], d, mu, "<-".join(ch.tags[j:]) + f" {d.text(False)}"
                           + (f" mu={mu}" if n - j > 2 else ""))
    return dict(zip(specs, run.many(list(specs.values()), prompts), strict=True))


def _inputs(ch: _Chain, j: int, t: dict[str, float], before: Run, tail_l: float, after: Run,
            k: int) -> InsertionInputs:
    """Theorem 3.2's inputs for level j between j-1 and j+1 (see :func:`insertion_inputs`)."""
    return insertion_inputs((ch.names[j - 1], ch.names[j], ch.names[j + 1]), t, before, tail_l, after, k)


def insertion_inputs(names: tuple[str, str, str], t: dict[str, float], before: Run, tail_l: float, after: Run,
                     k: int) -> InsertionInputs:
    """Theorem 3.2's inputs for inserting ``new`` between ``above`` and ``below`` (``names``): T at the chain's
    widths (``t``), L_i and beta from ``before`` (the chain without it), L_i_new from ``after`` (with it), L_new of
    the new level over the one below (``tail_l``)."""
    above, new, below = names
    beta = before.betas[before.levels.index(above)]
    return InsertionInputs(T_i=t[above], T_new=t[new], T_next=t[below], L_i=before.per_level[above].L,
                           L_new=tail_l, L_i_new=after.per_level[above].L, beta=beta or float(k))


def _insertion(ch: _Chain, j: int, final: dict[str, Run], costs: dict[str, list], c: _Choice) -> Insertion:
    """The verdict on level j at the chosen chain's (draft_k, mu), T at the chain's own widths."""
    before_key, tail_key = _run_keys(ch, j)
    chain, before = final["chain"], final[before_key]
    t = {nm: mean_cost(costs[nm], steady_widths(chain, nm)) for nm in ch.names}
    inputs = _inputs(ch, j, t, before, final[tail_key].per_level[ch.names[j]].L, chain, c.chain_draft.depth)
    v = insertion_verdict(inputs, level=ch.names[j], above=ch.names[j - 1], below=ch.names[j + 1],
                          label=f"{ch.tags[j]} {c.chain_draft.text(False)} mu={c.mu}", draft=c.chain_draft.text(),
                          mu=c.mu)
    v.before_run, v.tail_run = before_key, tail_key
    v.time_before_own_widths = before.predicted.time_per_token_s
    v.time_after_own_widths = chain.predicted.time_per_token_s
    v.pays_own_widths = v.time_after_own_widths < v.time_before_own_widths
    v.beta_chain = chain.betas[j]
    v.L_new_in_chain = chain.per_level[ch.names[j]].L
    v.L_new_in_chain_eff = chain.per_level[ch.names[j]].L_eff
    return v


def _candidates(ch: _Chain, j: int, grid: list[Run], costs: dict[str, list]) -> list[Insertion]:
    """Insertion j at every grid chain point whose chain without level j is also in the grid (three levels: dual),
    with L_new taken inside the chain (effective)."""
    out = []
    names_without = [ch.names[i] for i in _without(j, len(ch.levels))]
    for r in (r for r in grid if r.mode == "chain" and len(r.levels) == len(ch.levels)):
        d, mu = DraftSpec.model_validate(r.draft), r.mu[0]
        before = next((b for b in grid if b.levels == names_without and b.draft == r.draft), None)
        if before is None:
            continue
        t = {nm: mean_cost(costs[nm], steady_widths(r, nm)) for nm in ch.names}
        inputs = _inputs(ch, j, t, before, r.per_level[ch.names[j]].L_eff, r, d.depth)
        out.append(insertion_verdict(inputs, level=ch.names[j], above=ch.names[j - 1], below=ch.names[j + 1],
                                     label=f"{d.text(False)},mu={mu}", draft=d.text(), mu=mu))
    return out


def acceptance_checks(p: Profile) -> list[tuple[str, str, str, str]]:
    """(variance key, plot label, final-run key, level) of the acceptance distributions each insertion rests on:
    M_i over M_{i+1} without M_new, M_new over M_{i+1} alone and in the chain, M_i over M_new in the chain."""
    tags, out = p.tags, []
    for v in p.insertions:
        dual = v.before_run == "dual_at_chain_k"
        where = "dual" if dual else v.before_run
        out += [(f"{where}_{v.above}", f"{tags[v.above]} over {tags[v.below]} ({where})", v.before_run, v.above),
                (v.tail_run, f"{tags[v.level]} over {tags[v.below]}", v.tail_run, v.level),
                (f"chain_{v.level}", f"{tags[v.level]} over {tags[v.below]} (in chain)", "chain", v.level),
                (f"chain_{v.above}", f"{tags[v.above]} over {tags[v.level]} (chain)", "chain", v.above)]
    return list({key: (key, *rest) for key, *rest in out}.values())


def _variance(p: Profile, k: int, mu: int) -> dict[str, Any]:
    """Exact min(G, n) checks: n = draft_k + 1 for a verifier of the draft; blocks of >= mu for the others
    (approximate, n = the larger of mu + 1 and the level's typical forward width)."""
    out = {}
    for key, _label, run_key, level in acceptance_checks(p):
        run = p.final[run_key]
        lv = run.per_level[level]
        exact = run.levels.index(level) == len(run.levels) - 2
        n = k + 1 if exact else max(mu + 1, round(lv.mean_width))
        out[key] = variance_check(lengths_from_hist(lv.accept_hist or {}), n, approximate=not exact)
    return out


def _speedups(final: dict[str, Run], top: str) -> dict[str, Any]:
    pred = {nm: r.predicted.time_per_token_s for nm, r in final.items() if r.levels[0] == top}
    wall = {nm: final[nm].tokens_per_second for nm in pred}
    steady = {nm: final[nm].tokens_per_second_steady for nm in pred}
    return {"wall": speedup_summary(pred, wall, "dual"), "steady": speedup_summary(pred, steady, "dual"),
            "vs_ar": speedup_summary(pred, wall, "ar")}


def _prewarm(levels: list[Any], prompts: list[list[int]], s: ProfileSettings, say: Callable[[str], None]) -> None:
    """Every static-step width of every level compiled and captured before the grid (CUDA), on caches as long as
    the longest prompt's run needs, so that the grid's first configurations do not time the compiler (on the first
    GPU run they did: 13.6 s for 4 prompts)."""
    from polyspec.decode import cuda_graphs

    size = max(map(len, prompts), default=0) + s.max_new_tokens + cuda_graphs.BUCKETS[-1]
    cuda_graphs.prewarm((getattr(lv, "model", None) or getattr(lv, "head", None) for lv in levels), size,
                        say=lambda msg: say(f"profile: {msg}"))


def profile_levels(levels: list[Any], prompts: list[list[int]], s: ProfileSettings, *,
                   tags: list[str] | None = None, say: Callable[[str], None] | None = None) -> Profile:
    """Profile the chain ``levels`` (loaded ModelLevel / HeadLevel objects, target first, draft last, at least
    three) and decide its settings (see the module docstring). ``tags``: short names for labels (default: names)."""
    if len(levels) < 3:
        raise PolyspecError(f"profiling needs at least three levels (target, intermediate, draft), got {len(levels)}")
    ch = _Chain(list(levels), list(tags or [lv.name for lv in levels]))
    say = say or (lambda _msg: None)
    run = Runner(s, say)
    _prewarm(levels, prompts, s, say)
    grid_set = prompts[: s.grid_prompts or len(prompts)]
    grid = _grid_runs(run, ch, grid_set, s)
    costs = _costs(ch, grid, s, say)
    for r in grid:
        r.predicted = predict(r, costs)
    c = _choose([grid_row(r) for r in grid], s.confirm_duals)
    final = _final_runs(run, ch, prompts, c)
    confirmed = _keep_fastest_dual(c, final, say)
    for r in final.values():
        r.predicted = predict(r, costs)
    p = _profile(ch, s, prompts, grid_set, grid, final, costs, c)
    p.variance = _variance(p, c.chain_draft.depth, c.mu)
    p.notes["confirm_duals"] = confirmed
    return p


def _profile(ch: _Chain, s: ProfileSettings, prompts: list[list[int]], grid_set: list[list[int]], grid: list[Run],
             final: dict[str, Run], costs: dict[str, list], c: _Choice) -> Profile:
    """The verdicts on every insertion and the decision, with everything measured."""
    insertions = [_insertion(ch, j, final, costs, c) for j in range(1, len(ch.levels) - 1)]
    for j, v in enumerate(insertions, 1):
        v.candidates = _candidates(ch, j, grid, costs)
    grid_info = {"draft_k": list(s.draft_ks), "mu": list(s.mus), "prompts": len(grid_set),
                 "tree": s.tree.text(False) if s.tree is not None else None, "lookup": list(s.lookups)}
    ref = final["ar"].outputs
    return Profile(levels=[LevelInfo(name=nm, tag=tg) for nm, tg in zip(ch.names, ch.tags, strict=True)],
                   prompts=PromptInfo(count=len(prompts), grid_count=len(grid_set), max_new_tokens=s.max_new_tokens,
                                      lengths=[len(x) for x in prompts]),
                   kv_length=s.kv_length, warmup=s.warmup, repeats=s.repeats, costs=costs,
                   grid=[grid_row(r) for r in grid], final=final, insertions=insertions,
                   decision=decide(c.chosen, final, mu=c.mu, n_levels=len(ch.levels), grid=grid_info),
                   speedup=_speedups(final, ch.names[0]), variance={},
                   lossless_greedy=all(r.outputs == ref for r in final.values() if r.levels[0] == ch.names[0]))
