"""Forward costs T_i: the wall time of ONE forward of a level with ``width`` new tokens on top of a KV cache holding
``kv_length`` positions (the decoder's real shapes: width 1 for the draft, about draft_k + 1 for the level verifying
it, a block of >= mu tokens plus one for a level verifying blocks). Warm-up forwards first, then ``repeats`` timed
ones, the widths of a level taking turns; median, p10, p90, mean and min are kept. :func:`cost_at` / :func:`mean_cost` read a measured table back.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from polyspec.decode.timing import timed
from polyspec.errors import PolyspecError
from polyspec.export.results import CostRow


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


def _fill_cache(level: Any, prefix: list[int], kv_length: int, feats: Any) -> None:
    """Put ``kv_length`` positions in the level's cache (a feature reader starts at position 1: row p = f_{p-1})."""
    if feats is None:
        level.forward(prefix, 0)
    elif kv_length > 1:
        level.forward(prefix[1:], 1, feats[1:kv_length])


def time_forward(level: Any, width: int, kv_length: int, *, warmup: int = 2, repeats: int = 10,
                 hidden_size: int | None = None, vocab_size: int | None = None, seed: int = 0) -> CostRow:
    """Time one forward of ``level`` (a ModelLevel / HeadLevel) adding ``width`` tokens at position ``kv_length``
    (:func:`time_forwards` for one width)."""
    return time_forwards(level, [width], kv_length, warmup=warmup, repeats=repeats, hidden_size=hidden_size,
                         vocab_size=vocab_size, seed=seed)[0]


def time_forwards(level: Any, widths: list[int], kv_length: int, *, warmup: int = 2, repeats: int = 10,
                  hidden_size: int | None = None, vocab_size: int | None = None, seed: int = 0) -> list[CostRow]:
    """One :class:`CostRow` per width (in the order given): ``level``'s forward adding that many tokens at position
    ``kv_length``.

    The cache is filled once with ``kv_length`` random tokens (and random features for a feature-reading level of
    width ``hidden_size``); each timed call rolls back to ``kv_length`` (O(1)) and runs a block again. The widths take
    turns (one forward of each, ``warmup + repeats`` times over), so a machine whose speed drifts over seconds slows
    them alike: the decision compares T at different widths, and back-to-back repeats of one width at a time once
    timed a width-2 forward below a width-1 one on a noisy 2-core VM."""
    import torch

    if not widths or min(widths) < 1 or kv_length < 1:
        raise PolyspecError(f"time_forwards needs widths >= 1 and kv_length >= 1, got {widths}, {kv_length}")
    device = getattr(level, "device", torch.device("cpu"))
    needs = bool(getattr(level, "needs_features", False))
    if needs and not hidden_size:
        raise PolyspecError(f"level {level.name!r} reads features: pass hidden_size")
    gen = torch.Generator().manual_seed(seed)
    most = max(widths)
    prefix = torch.randint(0, int(vocab_size or 2), (kv_length,), generator=gen).tolist()
    block = torch.randint(0, int(vocab_size or 2), (most,), generator=gen).tolist()
    feats = torch.randn(kv_length + most, hidden_size, generator=gen) if needs else None  # [P, H]
    level.setup(kv_length + most + 1)
    _fill_cache(level, prefix, kv_length, feats)
    times: list[list[float]] = [[] for _ in widths]
    for i in range(warmup + repeats):
        for j, w in enumerate(widths):
            _, dt = timed(lambda w=w: level.forward(block[:w], kv_length, feats[kv_length:kv_length + w]
                                                    if needs else None), device)
            if i >= warmup:
                times[j].append(dt)
    level.reset()
    return [CostRow(width=w, kv_length=kv_length, **summarize_times(ts)) for w, ts in zip(widths, times, strict=True)]


def measure_costs(levels: dict[str, Any], widths: dict[str, list[int]], kv_length: int, *, warmup: int = 2,
                  repeats: int = 10, hidden_size: int | None = None, vocab_size: int | None = None
                  ) -> dict[str, list[CostRow]]:
    """``{level name: time_forwards(level, its widths, ...)}`` (widths sorted, deduplicated, taking turns)."""
    return {name: time_forwards(level, sorted(set(widths[name])), kv_length, warmup=warmup, repeats=repeats,
                                hidden_size=hidden_size, vocab_size=vocab_size)
            for name, level in levels.items()}


def cost_at(table: list[CostRow], width: float) -> float:
    """T(width) (median) from a measured table by piecewise-linear interpolation in width (linear extrapolation from
    the nearest two points outside the measured range, never below the smallest measured time)."""
    pts = sorted((float(r.width), float(r.median_s)) for r in table)
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


def mean_cost(table: list[CostRow], width_counts: dict[int, int]) -> float:
    """Mean forward cost over a histogram of forward widths: sum_w n_w T(w) / sum_w n_w."""
    total = sum(width_counts.values())
    if total == 0:
        raise PolyspecError("no forwards recorded for this level")
    return sum(n * cost_at(table, w) for w, n in width_counts.items()) / total


def grid_widths(seen: dict[str, set[int]], max_points: int = 12) -> dict[str, list[int]]:
    """Widths to time per level from the widths ``seen`` in the runs (plus nominal ones), thinned to ``max_points``
    (always keeping the smallest and the largest; :func:`cost_at` interpolates in between)."""
    out: dict[str, list[int]] = {}
    for name, ws_seen in seen.items():
        ws = sorted(ws_seen) or [1]
        if len(ws) > max_points:
            step = (len(ws) - 1) / (max_points - 1)
            ws = sorted({ws[round(i * step)] for i in range(max_points)})
        out[name] = ws
    return out
