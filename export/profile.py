"""Measuring a chain on the device: forward costs T_i and acceptance L_i (issue: pipeline end to end, "profile").

Two kinds of measurement, both plain functions over already loaded levels (see :mod:`polyspec.export.stage` for
loading them from folders):

* :func:`time_forward` / :func:`measure_costs`: the wall time of ONE forward of a level with ``width`` new tokens on
  top of a KV cache holding ``kv_length`` positions (the decoder's real shapes: width 1 for the draft, about
  draft_k + 1 for the level verifying it, a block of >= mu tokens plus one for the target in chain mode). Warm-up
  forwards first, then ``repeats`` timed ones; median, p10, p90, mean and min are kept.
* :func:`run_config`: greedy generation with :class:`~polyspec.decode.chain.ChainDecoder` on calibration prompts for
  one configuration (mode, levels, draft_k, mu). Every level is wrapped in a :class:`RecordingLevel` that records the
  width and wall time of each forward, so the result holds, per level: verifications, tokens emitted, the full
  acceptance-length distribution, the mean forward width, the seconds spent in forwards, and beta.

Definitions used throughout (per level i above the draft, N = tokens the chain output):
  L_i     = mean tokens emitted per verification of level i (accepted + correction/bonus; the paper's L_i)
  L_eff_i = N / verifications of level i (what Lemma 3.1 needs for the time per output token; equals L_i for the
            target, is smaller for an intermediate whose emitted tokens the target partly rejects)
  beta    = draft forwards per verification of the level directly above the draft (as the decoder
            reports it).
A level's first forward in each generation processes the prompt (a prefill): it is timed apart and left out of the
width histogram that steady-state costs are computed from.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from polyspec.errors import PolyspecError

# ---------------------------------------------------------------------------------------------------------------------
# Forward costs


def summarize_times(seconds: list[float]) -> dict[str, float]:
    """median, p10, p90, mean, min of a list of timings (seconds)."""
    if not seconds:
        raise PolyspecError("no timings to summarise (repeats must be >= 1)")
    xs = sorted(seconds)

    def q(p: float) -> float:  # linear interpolation between order statistics
        pos = p * (len(xs) - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"median_s": statistics.median(xs), "p10_s": q(0.1), "p90_s": q(0.9), "mean_s": statistics.fmean(xs),
            "min_s": xs[0], "repeats": len(xs)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_forward(level: Any, width: int, kv_length: int, *, warmup: int = 2, repeats: int = 10,
                 hidden_size: int | None = None, vocab_size: int | None = None, seed: int = 0) -> dict[str, float]:
    """Time one forward of ``level`` (a ModelLevel / HeadLevel) adding ``width`` tokens at position ``kv_length``.

    The cache is filled once with ``kv_length`` random tokens (and random features for a feature-reading level of
    width ``hidden_size``), then each timed call rolls back to ``kv_length`` (O(1)) and runs the block again.
    """
    if width < 1 or kv_length < 1:
        raise PolyspecError(f"time_forward needs width >= 1 and kv_length >= 1, got {width}, {kv_length}")
    device = getattr(level, "device", torch.device("cpu"))
    needs = bool(getattr(level, "needs_features", False))
    if needs and not hidden_size:
        raise PolyspecError(f"level {level.name!r} reads features: pass hidden_size")
    vocab = int(vocab_size or 2)
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (kv_length,), generator=gen).tolist()
    block = torch.randint(0, vocab, (width,), generator=gen).tolist()
    level.setup(kv_length + width + 1)
    if needs:
        feats = torch.randn(kv_length + width, hidden_size, generator=gen)  # [P, H]: row p = f_{p-1}
        if kv_length > 1:
            level.forward(prefix[1:], 1, feats[1:kv_length])
        block_feats = feats[kv_length:kv_length + width]  # [width, H]
    else:
        level.forward(prefix, 0)
        block_feats = None
    times: list[float] = []
    for i in range(warmup + repeats):
        _sync(device)
        t0 = time.perf_counter()
        logits, _ = level.forward(block, kv_length, block_feats)
        float(logits[-1, 0])  # make sure the work is done (and on CUDA, synchronised)
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
    level.reset()
    return {"width": width, "kv_length": kv_length, **summarize_times(times)}


def measure_costs(levels: dict[str, Any], widths: dict[str, list[int]], kv_length: int, *, warmup: int = 2,
                  repeats: int = 10, hidden_size: int | None = None, vocab_size: int | None = None
                  ) -> dict[str, list[dict[str, float]]]:
    """``{level name: [time_forward(...) for each width]}`` (widths sorted, deduplicated)."""
    out: dict[str, list[dict[str, float]]] = {}
    for name, level in levels.items():
        rows = [time_forward(level, w, kv_length, warmup=warmup, repeats=repeats, hidden_size=hidden_size,
                             vocab_size=vocab_size) for w in sorted(set(widths[name]))]
        out[name] = rows
    return out


def cost_at(table: list[dict[str, float]], width: float, key: str = "median_s") -> float:
    """T(width) from a measured table by piecewise-linear interpolation in width (linear extrapolation from the
    nearest two points outside the measured range, never below the smallest measured time)."""
    pts = sorted((float(r["width"]), float(r[key])) for r in table)
    if not pts:
        raise PolyspecError("empty cost table")
    if len(pts) == 1:
        return pts[0][1]
    if width <= pts[0][0]:
        (x0, y0), (x1, y1) = pts[0], pts[1]
    elif width >= pts[-1][0]:
        (x0, y0), (x1, y1) = pts[-2], pts[-1]
    else:
        j = next(i for i in range(1, len(pts)) if pts[i][0] >= width)
        (x0, y0), (x1, y1) = pts[j - 1], pts[j]
    y = y0 + (y1 - y0) * (width - x0) / (x1 - x0)
    return max(y, min(p[1] for p in pts))


def mean_cost(table: list[dict[str, float]], width_counts: dict[int, int]) -> float:
    """Mean forward cost over a histogram of forward widths: sum_w n_w T(w) / sum_w n_w."""
    total = sum(width_counts.values())
    if total == 0:
        raise PolyspecError("no forwards recorded for this level")
    return sum(n * cost_at(table, w) for w, n in width_counts.items()) / total


# ---------------------------------------------------------------------------------------------------------------------
# Acceptance


class RecordingLevel:
    """A chain level that records (width, seconds) of every forward of the level it wraps."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.name = inner.name
        self.kind = getattr(inner, "kind", "model")
        self.needs_features = inner.needs_features
        self.calls: list[tuple[int, float, bool]] = []  # (width, seconds, prefill: first forward after a reset)
        self._fresh = True
        # ChainDecoder refuses the same model twice by identity of .model / .head: expose the wrapped one.
        for attr in ("model", "head"):
            if hasattr(inner, attr):
                setattr(self, attr, getattr(inner, attr))

    @property
    def device(self) -> torch.device:
        return getattr(self.inner, "device", torch.device("cpu"))

    @property
    def cache_len(self) -> int:
        return self.inner.cache_len

    def setup(self, max_seq_len: int) -> None:
        self.inner.setup(max_seq_len)

    def reset(self) -> None:
        self.inner.reset()
        self._fresh = True

    def truncate(self, n: int) -> None:
        self.inner.truncate(n)

    def _timed(self, width: int, call: Any) -> Any:
        """Run ``call()`` (one forward of ``width`` tokens) and record (width, seconds, prefill)."""
        _sync(self.device)
        t0 = time.perf_counter()
        out = call()
        _sync(self.device)
        self.calls.append((width, time.perf_counter() - t0, self._fresh))
        self._fresh = False
        return out

    def forward(self, tokens: list[int], start_pos: int, features: torch.Tensor | None = None, *,
                last_only: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._timed(len(tokens), lambda: self.inner.forward(tokens, start_pos, features, last_only=last_only))

    def __getattr__(self, name: str) -> Any:
        # The tree methods exist only when the wrapped level has them (ChainDecoder checks with hasattr).
        if name == "forward_tree" and hasattr(self.inner, "forward_tree"):
            return self._forward_tree
        if name == "compact" and hasattr(self.inner, "compact"):
            return self.inner.compact
        raise AttributeError(name)

    def _forward_tree(self, tokens: list[int], positions: list[int], mask: torch.Tensor,
                      features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._timed(len(tokens), lambda: self.inner.forward_tree(tokens, positions, mask, features))


@dataclass
class LevelRecord:
    """What one level did over all prompts of one configuration."""

    name: str
    forward_passes: int = 0
    catch_up_passes: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # verifiers: tokens emitted per verification
    tokens_emitted: int = 0
    widths: Counter = field(default_factory=Counter)  # forward width -> count (steady forwards: prefills excluded)
    forward_seconds: float = 0.0  # all forwards
    prefill_seconds: float = 0.0  # the first forward of each generation (it processes the prompt)


def histogram(values: list[int]) -> dict[str, int]:
    """{value: count} with string keys (JSON-friendly), sorted by value."""
    c = Counter(int(v) for v in values)
    return {str(k): c[k] for k in sorted(c)}


def run_config(levels: list[Any], prompts: list[list[int]], max_new_tokens: int, *, draft_k: int,
               mu: list[int] | None = None, eos_ids: set[int] | frozenset[int] = frozenset(),
               label: str = "", tree: Any = None) -> dict[str, Any]:
    """Greedy generation over ``prompts`` with a chain of ``levels`` (top first); aggregated measurements.

    ``tree``: a :class:`~polyspec.decode.chain.TreeParams` for an EAGLE-2 draft tree (then ``draft_k`` is unused and
    reported as the tree's depth).

    Returns ``{"label", "mode", "levels": [names], "draft_k", "mu", "tree", "prompts", "new_tokens", "seconds",
    "tokens_per_second", "forward_seconds", "beta", "outputs": [token ids per prompt], "per_level": {name: {...}}}``.
    ``seconds`` is the decoders' own generate time (prefill included), summed over prompts.
    """
    from polyspec.decode.chain import ChainDecoder, SamplingParams

    if not prompts:
        raise PolyspecError("run_config needs at least one calibration prompt")
    wrapped = [RecordingLevel(lv) for lv in levels]
    longest = max(len(p) for p in prompts)
    dec = ChainDecoder(wrapped, draft_k=draft_k, mu=list(mu or []) if len(levels) > 2 else [],
                       max_seq_len=longest + max_new_tokens + max(draft_k, max(mu or [0])) + 8,
                       tree=tree if len(levels) > 1 else None)
    records = {lv.name: LevelRecord(lv.name) for lv in wrapped}
    outputs: list[list[int]] = []
    seconds = 0.0
    beta_num = beta_den = 0
    for ids in prompts:
        for w in wrapped:
            w.calls.clear()
        res = dec.generate(list(ids), max_new_tokens, SamplingParams(), seed=0, eos_token_ids=eos_ids)
        outputs.append(list(res.token_ids))
        seconds += float(res.stats["seconds"])
        for w, st in zip(wrapped, res.level_stats, strict=True):
            r = records[w.name]
            r.forward_passes += st.forward_passes
            r.catch_up_passes += st.catch_up_passes
            r.accept_lengths += list(st.accept_lengths)
            r.tokens_emitted += st.tokens_emitted
            r.widths.update(width for width, _, pre in w.calls if not pre)
            r.forward_seconds += sum(s for _, s, _ in w.calls)
            r.prefill_seconds += sum(s for _, s, pre in w.calls if pre)
        if len(wrapped) >= 2:
            beta_num += res.level_stats[-1].forward_passes
            beta_den += len(res.level_stats[-2].accept_lengths)
    n = sum(len(o) for o in outputs)
    per_level: dict[str, Any] = {}
    for i, w in enumerate(wrapped):
        r = records[w.name]
        verifications = len(r.accept_lengths)
        entry: dict[str, Any] = {
            "forward_passes": r.forward_passes,
            "catch_up_passes": r.catch_up_passes,
            "widths": {str(k): r.widths[k] for k in sorted(r.widths)},
            "mean_width": (sum(k * c for k, c in r.widths.items()) / sum(r.widths.values())) if r.widths else 0.0,
            "forward_seconds": r.forward_seconds,
            "prefill_seconds": r.prefill_seconds,
        }
        if i < len(wrapped) - 1 or len(wrapped) == 1:
            lengths = r.accept_lengths
            entry.update({
                "verifications": verifications,
                "tokens_emitted": sum(lengths),
                "L": statistics.fmean(lengths) if lengths else 0.0,
                "L_eff": n / verifications if verifications else 0.0,
                "L_var": statistics.pvariance(lengths) if len(lengths) > 1 else 0.0,
                "accept_hist": histogram(lengths),
            })
        else:
            entry.update({"tokens_proposed": r.tokens_emitted})
        per_level[w.name] = entry
    mode = {1: "ar", 2: "dual"}.get(len(levels), "chain")
    return {
        "label": label or mode,
        "mode": mode,
        "levels": [w.name for w in wrapped],
        "draft_k": (tree.depth if tree is not None else draft_k) if len(levels) > 1 else None,
        "mu": list(dec.mu),
        "tree": asdict(tree) if tree is not None and len(levels) > 1 else None,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "new_tokens": n,
        "seconds": seconds,
        "tokens_per_second": n / seconds if seconds > 0 else 0.0,
        "forward_seconds": sum(r.forward_seconds for r in records.values()),
        "prefill_seconds": sum(r.prefill_seconds for r in records.values()),
        "tokens_per_second_steady": n / (seconds - sum(r.prefill_seconds for r in records.values()))
        if seconds > sum(r.prefill_seconds for r in records.values()) else 0.0,
        "beta": (beta_num / beta_den) if beta_den else None,
        "outputs": outputs,
        "per_level": per_level,
    }


def steady_widths(config: dict[str, Any], name: str) -> dict[int, int]:
    """Forward widths of one level in a run (prefill forwards excluded): {width: count}."""
    return {int(k): int(v) for k, v in config["per_level"][name]["widths"].items() if int(v) > 0}


def predicted_time_per_token(config: dict[str, Any], costs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """Lemma 3.1 for one measured configuration: T/N = sum_{i<n} T_i / L_eff_i + beta T_n / L_eff_{n-1}.

    T_i = the mean measured forward cost over the level's own (non catch-up) forward widths in that run, so blocks
    that are wider than draft_k + 1 or mu + 1 are charged what they cost. Returns the time and the terms used.
    """
    from polyspec.theory import chain_time_per_token

    names = config["levels"]
    t = [mean_cost(costs[nm], steady_widths(config, nm)) for nm in names]
    if len(names) == 1:
        return {"time_per_token_s": chain_time_per_token(t, []), "T": t, "L_eff": [], "beta": None}
    ls = [config["per_level"][nm]["L_eff"] for nm in names[:-1]]
    beta = config["beta"] or 1.0
    return {"time_per_token_s": chain_time_per_token(t, ls, beta), "T": t, "L_eff": ls, "beta": beta}


# ---------------------------------------------------------------------------------------------------------------------
# Calibration prompts


def calibration_prompts(tokenizer: Any, n: int, *, data_source: str | None = None,
                        max_conversations: int | None = None, heldout_fraction: float = 0.02, seed: int = 0,
                        max_prompt_tokens: int = 384) -> list[dict[str, Any]]:
    """``n`` chat prompts, alternating MT-bench first turns and first user turns of held-out ShareGPT conversations
    (split exactly as the data stage splits them), each through the tokenizer's chat template.

    Returns ``[{"source": "mtbench" | "sharegpt", "id": ..., "input_ids": [...]}, ...]``; prompts longer than
    ``max_prompt_tokens`` are skipped. Sources that are not installed contribute nothing (the other fills in); none
    at all raises PolyspecError.
    """
    from polyspec.decode.generate import encode_prompt

    pools: list[list[tuple[str, Any, str]]] = []
    problems: list[str] = []
    try:
        from polyspec.data.prompts import mtbench_questions

        pools.append([("mtbench", q.question_id, q.turns[0]) for q in mtbench_questions() if q.turns])
    except PolyspecError as exc:
        problems.append(f"MT-bench: {exc}")
    if data_source:
        try:
            from polyspec.data.prepare import split_indices
            from polyspec.data.sharegpt import load_conversations

            convs, _ = load_conversations(data_source, max_conversations=max_conversations)
            _, held = split_indices(len(convs), heldout_fraction, seed)
            firsts = []
            for i in held:
                user = next((m["content"] for m in convs[i] if m["role"] == "user"), None)
                if user:
                    firsts.append(("sharegpt", i, user))
            pools.append(firsts)
        except PolyspecError as exc:
            problems.append(f"ShareGPT ({data_source}): {exc}")
    out: list[dict[str, Any]] = []
    cursors = [0] * len(pools)
    while len(out) < n and any(c < len(p) for c, p in zip(cursors, pools, strict=True)):
        for j, pool in enumerate(pools):
            while cursors[j] < len(pool) and len(out) < n:
                src, qid, text = pool[cursors[j]]
                cursors[j] += 1
                ids = encode_prompt(tokenizer, text)
                if len(ids) <= max_prompt_tokens:
                    out.append({"source": src, "id": qid, "input_ids": ids})
                    break
    if not out:
        raise PolyspecError("no calibration prompts: " + ("; ".join(problems) or "the prompt sources are empty"))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The whole profile of a three-level chain


def _grid_widths(configs: list[dict[str, Any]], names: list[str], extra: dict[str, set[int]],
                 max_points: int = 12) -> dict[str, list[int]]:
    """Widths to time per level: every steady width seen in ``configs`` plus ``extra``, thinned to ``max_points``
    (always keeping the smallest and the largest; :func:`cost_at` interpolates in between)."""
    out: dict[str, list[int]] = {}
    for nm in names:
        seen = set(extra.get(nm, set()))
        for c in configs:
            if nm in c["per_level"]:
                seen |= set(steady_widths(c, nm))
        ws = sorted(seen) or [1]
        if len(ws) > max_points:
            step = (len(ws) - 1) / (max_points - 1)
            ws = sorted({ws[round(i * step)] for i in range(max_points)})
        out[nm] = ws
    return out


def profile_models(target: Any, int4: Any, head: Any, prompts: list[list[int]], *, max_new_tokens: int,
                   kv_length: int, warmup: int = 2, repeats: int = 10, draft_ks: tuple[int, ...] = (2, 3, 4, 5),
                   mus: tuple[int, ...] = (4, 6, 8, 12), grid_prompts: int | None = None,
                   eos_ids: set[int] | frozenset[int] = frozenset(), say: Any = None,
                   tree: Any = None) -> dict[str, Any]:
    """Profile the chain target <- int4 <- head (loaded models) and decide its settings.

    1. Grid: dual (target <- head) for every draft_k and chain (target <- int4 <- head) for every (draft_k, mu), on
       the first ``grid_prompts`` prompts (default all); with ``tree`` (TreeParams) also dual and chain (every mu)
       with that EAGLE-2 draft tree, so the decision weighs linear drafts against the tree.
    2. Costs: T(width) of each level at every forward width the grid used, over ``kv_length`` cached positions.
    3. Prediction: Lemma 3.1 time per token for every grid point; the chosen chain / dual configuration minimises
       it; the dual baseline is the best dual.
    4. Final measurements on all prompts: ar, the dual baseline, the chosen configuration, dual at the chosen
       draft_k and int4 <- head at the chosen draft_k: L_i, L_new, L_i_new, beta, acceptance distributions,
       tokens/s; the insertion verdict; predicted vs measured speedups; the variance check.
    """
    from polyspec.decode.levels import HeadLevel, ModelLevel
    from polyspec.export.verdict import (
        choose_config,
        insertion_verdict,
        speedup_summary,
        variance_check,
    )

    say = say or (lambda _msg: None)
    lv_t, lv_q, lv_h = ModelLevel(target, "target"), ModelLevel(int4, "intermediate"), HeadLevel(head, "draft")
    grid_set = prompts[: grid_prompts or len(prompts)]
    runs: dict[tuple, dict[str, Any]] = {}

    def run(levels: list[Any], k: int, mu: int | None, ps: list[list[int]], tag: str,
            tr: Any = None) -> dict[str, Any]:
        key = (tuple(lv.name for lv in levels), k if len(levels) > 1 else None, mu if len(levels) > 2 else None,
               len(ps), tuple(asdict(tr).values()) if tr is not None else None)
        if key not in runs:
            t0 = time.perf_counter()
            runs[key] = run_config(levels, ps, max_new_tokens, draft_k=k, mu=[mu] if len(levels) > 2 else None,
                                   eos_ids=eos_ids, label=tag, tree=tr)
            say(f"profile: {tag:<28} L={_fmt_l(runs[key])} {runs[key]['tokens_per_second']:.1f} tok/s "
                f"({time.perf_counter() - t0:.1f} s)")
        return runs[key]

    grid_runs: list[dict[str, Any]] = []
    for k in draft_ks:
        grid_runs.append(run([lv_t, lv_h], k, None, grid_set, f"grid dual k={k}"))
        for mu in mus:
            grid_runs.append(run([lv_t, lv_q, lv_h], k, mu, grid_set, f"grid chain k={k} mu={mu}"))
    shape = f"tree {tree.top_k}x{tree.depth}/{tree.total_tokens}" if tree is not None else ""
    if tree is not None:
        grid_runs.append(run([lv_t, lv_h], tree.depth, None, grid_set, f"grid dual {shape}", tree))
        for mu in mus:
            grid_runs.append(run([lv_t, lv_q, lv_h], tree.depth, mu, grid_set, f"grid chain {shape} mu={mu}", tree))
    grid_runs.append(run([lv_t], 1, None, grid_set, "grid ar"))

    names = ["target", "intermediate", "draft"]
    nominal = {"target": {1, *(k + 1 for k in draft_ks), *(m + 1 for m in mus)},
               "intermediate": {1, *(k + 1 for k in draft_ks)}, "draft": {1, 2}}
    widths = _grid_widths(grid_runs, names, nominal)
    say(f"profile: timing forwards at kv_length={kv_length}: " + ", ".join(f"{n} {w}" for n, w in widths.items()))
    costs = measure_costs({"target": lv_t, "intermediate": lv_q, "draft": lv_h}, widths, kv_length, warmup=warmup,
                          repeats=repeats, hidden_size=target.args.hidden_size, vocab_size=target.args.vocab_size)

    grid_rows = [_row(c, costs) for c in grid_runs]
    chosen = choose_config(grid_rows, ("chain", "dual"))
    best_dual = choose_config(grid_rows, ("dual",))
    best_chain = choose_config(grid_rows, ("chain",))
    k_star = chosen["draft_k"]
    mu_star = best_chain["mu"][0] if chosen["mode"] == "dual" else chosen["mu"][0]
    k_chain = best_chain["draft_k"] if chosen["mode"] == "dual" else k_star
    # A row's tree (a dict) back to the TreeParams the runs are keyed by.
    t_dual, t_chain = (tree if r.get("tree") else None for r in (best_dual, best_chain))
    tag_dual = shape if t_dual else f"k={best_dual['draft_k']}"
    tag_chain = shape if t_chain else f"k={k_chain}"

    final = {
        "ar": run([lv_t], 1, None, prompts, "ar"),
        "dual": run([lv_t, lv_h], best_dual["draft_k"], None, prompts, f"dual {tag_dual}", t_dual),
        "chain": run([lv_t, lv_q, lv_h], k_chain, mu_star, prompts, f"chain {tag_chain} mu={mu_star}", t_chain),
    }
    same = (k_chain == best_dual["draft_k"] and t_chain == t_dual)  # the chain's draft setting is dual's: run it once
    final["dual_at_chain_k"] = final["dual"] if same else run([lv_t, lv_h], k_chain, None, prompts,
                                                               f"dual {tag_chain}", t_chain)
    final["int4_over_head"] = run([lv_q, lv_h], k_chain, None, prompts, f"int4<-head {tag_chain}", t_chain)
    ref = final["ar"]["outputs"]
    lossless = all(c["outputs"] == ref for c in final.values() if c["levels"][0] == "target")

    # The insertion verdict at the chain's (draft_k, mu): the paper's quantities, T at the chain's own widths.
    ch, du, qh = final["chain"], final["dual_at_chain_k"], final["int4_over_head"]
    t_ch = {nm: mean_cost(costs[nm], steady_widths(ch, nm)) for nm in names}
    verdict = insertion_verdict(
        t_ch["target"], t_ch["intermediate"], t_ch["draft"], du["per_level"]["target"]["L"],
        qh["per_level"]["intermediate"]["L"], ch["per_level"]["target"]["L"], du["beta"] or float(k_chain),
        label=f"int4 k={k_chain} mu={mu_star}", draft_k=k_chain, mu=mu_star)
    own_before = predicted_time_per_token(du, costs)["time_per_token_s"]
    own_after = predicted_time_per_token(ch, costs)["time_per_token_s"]
    verdict.update({"time_before_own_widths": own_before, "time_after_own_widths": own_after,
                    "pays_own_widths": own_after < own_before, "beta_chain": ch["beta"],
                    "L_new_in_chain": ch["per_level"]["intermediate"]["L"],
                    "L_new_in_chain_eff": ch["per_level"]["intermediate"]["L_eff"]})
    candidates = [_grid_candidate(c, grid_runs, costs) for c in grid_runs if c["mode"] == "chain"]

    predicted = {nm: predicted_time_per_token(c, costs)["time_per_token_s"] for nm, c in final.items()
                 if c["levels"][0] == "target"}
    speed_wall = speedup_summary(predicted, {nm: c["tokens_per_second"] for nm, c in final.items()
                                             if nm in predicted}, "dual")
    speed_steady = speedup_summary(predicted, {nm: c["tokens_per_second_steady"] for nm, c in final.items()
                                               if nm in predicted}, "dual")
    speed_vs_ar = speedup_summary(predicted, {nm: c["tokens_per_second"] for nm, c in final.items()
                                              if nm in predicted}, "ar")

    variance = {
        "dual_target": variance_check(_lengths(du, "target"), k_chain + 1),
        "int4_over_head": variance_check(_lengths(qh, "intermediate"), k_chain + 1),
        "chain_intermediate": variance_check(_lengths(ch, "intermediate"), k_chain + 1),
        "chain_target": variance_check(_lengths(ch, "target"),
                                       max(mu_star + 1, round(ch["per_level"]["target"]["mean_width"])),
                                       approximate=True),
    }
    # When plain decoding is predicted faster than the best speculative configuration on this device, or the final
    # runs measured the chosen configuration no faster than ar (Lemma 3.1 leaves out the decoder's own per-round
    # work), the chain decodes with ar by default; the tuned speculative settings stay for --mode dual / chain.
    ar_faster = predicted["ar"] < min(predicted["dual"], predicted["chain"])
    ar_measured = final["ar"]["tokens_per_second"] >= final[chosen["mode"]]["tokens_per_second"]
    decision = {
        "mode": "ar" if ar_faster or ar_measured else chosen["mode"],
        "speculative_mode": chosen["mode"],
        "draft_k": k_star,
        "mu": [mu_star],
        "tree": chosen.get("tree"),
        "predicted_time_per_token_s": chosen["predicted_time_per_token_s"],
        "grid": {"draft_k": list(draft_ks), "mu": list(mus), "prompts": len(grid_set),
                 "tree": asdict(tree) if tree is not None else None},
        "ar_predicted_faster": ar_faster,
        "ar_measured_faster": ar_measured,
        "rule": "min over the grid of the Lemma 3.1 time per token (measured T at the run's own forward widths, "
                "measured L_eff and beta), modes chain and dual, linear drafts and (when given) the draft tree; "
                "mode ar when ar's predicted time beats the measured dual baseline and chosen chain, or when the "
                "final runs measured ar at least as fast as the chosen configuration",
    }
    return {
        "prompts": {"count": len(prompts), "grid_count": len(grid_set), "max_new_tokens": max_new_tokens,
                    "lengths": [len(p) for p in prompts]},
        "kv_length": kv_length,
        "warmup": warmup,
        "repeats": repeats,
        "costs": costs,
        "grid": grid_rows,
        "final": {nm: _strip(c) | {"predicted": predicted_time_per_token(c, costs)} for nm, c in final.items()},
        "L": {
            "L_i": du["per_level"]["target"]["L"],
            "L_new": qh["per_level"]["intermediate"]["L"],
            "L_i_new": ch["per_level"]["target"]["L"],
            "beta_dual": du["beta"],
            "beta_chain": ch["beta"],
            "chain": {nm: ch["per_level"][nm].get("L") for nm in names[:-1]},
            "draft_k": k_chain,
            "mu": mu_star,
        },
        "verdict": verdict,
        "candidates": candidates,
        "decision": decision,
        "speedup": {"wall": speed_wall, "steady": speed_steady, "vs_ar": speed_vs_ar},
        "variance": variance,
        "lossless_greedy": lossless,
    }


def _lengths(config: dict[str, Any], name: str) -> list[int]:
    from polyspec.export.verdict import lengths_from_hist

    return lengths_from_hist(config["per_level"][name].get("accept_hist", {}))


def _fmt_l(config: dict[str, Any]) -> str:
    return "/".join(f"{v['L']:.2f}" for v in config["per_level"].values() if "L" in v)


def _strip(config: dict[str, Any]) -> dict[str, Any]:
    """A run without its generated token ids (kept out of tables)."""
    return {k: v for k, v in config.items() if k != "outputs"}


def _row(config: dict[str, Any], costs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    pred = predicted_time_per_token(config, costs)
    return {
        "label": config["label"], "mode": config["mode"], "draft_k": config["draft_k"], "mu": config["mu"],
        "tree": config.get("tree"),
        "L": {nm: v["L"] for nm, v in config["per_level"].items() if "L" in v},
        "L_eff": {nm: v["L_eff"] for nm, v in config["per_level"].items() if "L_eff" in v},
        "beta": config["beta"], "T_s": dict(zip(config["levels"], pred["T"], strict=True)),
        "predicted_time_per_token_s": pred["time_per_token_s"],
        "measured_tokens_per_second": config["tokens_per_second"],
        "measured_tokens_per_second_steady": config["tokens_per_second_steady"],
        "new_tokens": config["new_tokens"],
    }


def _grid_candidate(chain: dict[str, Any], grid_runs: list[dict[str, Any]],
                    costs: dict[str, list[dict[str, float]]]) -> dict[str, Any]:
    """The insertion verdict of one grid chain point, with L_new taken inside the chain (effective)."""
    from polyspec.export.verdict import insertion_verdict

    k, mu = chain["draft_k"], chain["mu"][0]
    dual = next(c for c in grid_runs
                if c["mode"] == "dual" and c["draft_k"] == k and c.get("tree") == chain.get("tree"))
    t = {nm: mean_cost(costs[nm], steady_widths(chain, nm)) for nm in chain["levels"]}
    return insertion_verdict(t["target"], t["intermediate"], t["draft"], dual["per_level"]["target"]["L"],
                             chain["per_level"]["intermediate"]["L_eff"], chain["per_level"]["target"]["L"],
                             dual["beta"] or float(k), label=f"{'tree' if chain.get('tree') else 'k'}={k},mu={mu}",
                             draft_k=k, mu=mu)
