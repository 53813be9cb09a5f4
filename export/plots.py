"""PNG plots of a profile: the insertion region and the acceptance-length histograms (matplotlib, Agg backend).

Both take pieces of a :class:`~polyspec.export.results.Profile` (insertion verdicts, acceptance histograms) and write
the file atomically; matplotlib is imported inside the functions.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from polyspec.errors import PolyspecError


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise PolyspecError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _save(fig: Any, out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out.stem}.", suffix=".png", dir=out.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, dpi=110, bbox_inches="tight")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def region_lines(inputs: dict[str, float], xs: list[float]) -> dict[str, list[float]]:
    """Boundaries in the (x = T_new / T_i, y = L_new) plane for fixed T_i, T_next, L_i, L_i_new, beta.

    cond1: x < y (1/L_i - 1/L_i_new)        -> holds above y1(x) = x / (1/L_i - 1/L_i_new) (when L_i_new > L_i)
    cond2: x T_i/T_next < beta (y/L_i - 1)   -> holds above y2(x) = L_i (1 + x T_i / (beta T_next))
    exact: T_i/L_i_new + (x T_i + beta T_next)/y < (T_i + beta T_next)/L_i
                                             -> pays above y3(x) = (x T_i + beta T_next) / ((T_i + beta T_next)/L_i
                                                - T_i/L_i_new)   (when the denominator is > 0; else never)
    """
    t_i, t_next, l_i, l_in, beta = (inputs[k] for k in ("T_i", "T_next", "L_i", "L_i_new", "beta"))
    inf = float("inf")
    gap = 1.0 / l_i - 1.0 / l_in
    y1 = [x / gap if gap > 0 else inf for x in xs]
    y2 = [l_i * (1.0 + x * t_i / (beta * t_next)) for x in xs]
    den = (t_i + beta * t_next) / l_i - t_i / l_in
    y3 = [(x * t_i + beta * t_next) / den if den > 0 else inf for x in xs]
    return {"cond1": y1, "cond2": y2, "exact": y3}


def _region_panel(ax: Any, v: Any, tags: dict[str, str]) -> None:
    """One insertion's plane: cond1 / cond2 / exact Lemma 3.1 boundaries, the verdict as a star, its candidates
    (the same insertion at every grid chain point) as dots at (T_new / T_i, L_new)."""
    inp = asdict(v.inputs)
    new, above, below = tags.get(v.level, v.level), tags.get(v.above, v.above), tags.get(v.below, v.below)
    pts = [(c.inputs.T_new / c.inputs.T_i, c.inputs.L_new, c) for c in [v, *v.candidates]]
    xmax = max(1.0, 1.3 * max(p[0] for p in pts))
    ymax = 1.1 * max(inp["L_i_new"], 1.2 * max(p[1] for p in pts), inp["L_i"] * 1.4)
    xs = [xmax * i / 200 for i in range(201)]
    lines = region_lines(inp, xs)
    ax.fill_between(xs, [min(y, ymax) for y in lines["exact"]], ymax, color="tab:green", alpha=0.12,
                    label="inserting pays (exact, Lemma 3.1)")
    ax.plot(xs, lines["cond1"], color="tab:blue", label="cond1 boundary (holds above)")
    ax.plot(xs, lines["cond2"], color="tab:orange", label="cond2 boundary (holds above)")
    ax.axhline(inp["L_i"], color="grey", lw=0.8, ls=":", label=f"L_i ({above} over {below})")
    ax.axhline(inp["L_i_new"], color="grey", lw=0.8, ls="--", label=f"L_i_new ({above} over {new})")
    for x, y, c in pts:
        main = c is v
        ax.scatter([x], [y], marker="*" if main else "o", s=140 if main else 30,
                   color=("tab:green" if c.pays else "tab:red"), edgecolor="black", zorder=3)
        ax.annotate(c.label, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlim(0, xmax)
    ax.set_ylim(0, ymax)
    ax.set_xlabel(f"T_new / T_i  ({new} forward cost relative to {above}'s)")
    ax.set_ylabel(f"L_new  (tokens per {new} verification; grid points: N / {new} forwards)")
    ax.set_title(f"Inserting the {new} level between {above} and {below}")
    ax.legend(fontsize=7, loc="upper right")


def plot_insertion_regions(insertions: list[Any], tags: dict[str, str], out: Path) -> Path:
    """One panel per insertion verdict (:class:`~polyspec.export.results.Insertion`); see :func:`_region_panel`."""
    plt = _pyplot()
    if not insertions:
        raise PolyspecError("no insertion verdicts to plot")
    fig, axes = plt.subplots(1, len(insertions), figsize=(6.4 * len(insertions), 4.8), squeeze=False)
    for ax, v in zip(axes[0], insertions, strict=True):
        _region_panel(ax, v, tags)
    try:
        return _save(fig, out)
    finally:
        plt.close(fig)


def plot_acceptance_histograms(series: list[dict[str, Any]], out: Path, title: str = "") -> Path:
    """One panel per ``{"label", "hist": {"k": count}, "n", "alpha"}``: measured distribution of tokens per
    verification, with the exact pmf of min(G, n) at the fitted alpha as dots."""
    plt = _pyplot()
    if not series:
        raise PolyspecError("no acceptance distributions to plot")
    fig, axes = plt.subplots(1, len(series), figsize=(3.6 * len(series), 3.2), squeeze=False)
    for ax, s in zip(axes[0], series, strict=True):
        hist = {int(k): int(v) for k, v in s["hist"].items()}
        total = sum(hist.values()) or 1
        ks = list(range(1, max([*hist, int(s.get("n") or 1)]) + 1))
        ax.bar(ks, [hist.get(k, 0) / total for k in ks], color="tab:blue", alpha=0.7, label="measured")
        a, n = s.get("alpha"), s.get("n")
        if a is not None and n:
            pmf = [(a ** (k - 1)) * (1 - a) if k < n else a ** (n - 1) for k in range(1, int(n) + 1)]
            ax.plot(range(1, int(n) + 1), pmf, "o", color="tab:red", ms=4, label=f"min(G,{n}), alpha={a:.2f}")
        ax.set_title(s["label"], fontsize=9)
        ax.set_xlabel("tokens per verification")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("share of verifications")
    if title:
        fig.suptitle(title, fontsize=10)
    try:
        return _save(fig, out)
    finally:
        plt.close(fig)
