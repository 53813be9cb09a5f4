"""What ``polyspec bench`` shows and writes: a rich table for people, JSON for machines, PNG plots.

Plots (matplotlib, imported only here and only when asked): speedup over ``ar`` by category and mode (grouped bars,
"overall" last), and one histogram per (mode, verifier level) of the tokens emitted per verification.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from polyspec import fsutil


def _fmt(x: Any, spec: str) -> str:
    return "—" if x is None else format(x, spec)


def _accepted(d: dict[str, float]) -> str:
    return " · ".join(f"{k} {v:.2f}" for k, v in d.items()) or "—"


def report_rows(report: dict[str, Any]) -> list[list[str]]:
    """[category, mode, generations, new tokens, seconds, tok/s, speedup, mean accepted per level] rows."""
    rows = []
    blocks = [*sorted(report.get("by_category", {}).items()), ("overall", report.get("overall", {}))]
    for cat, by_mode in blocks:
        for mode, s in by_mode.items():
            if s.get("not_applicable"):
                rows.append([cat, mode, "", "", "", "n/a", "", s["not_applicable"][:90]])
                continue
            rows.append([cat, mode, str(s.get("generations", "")), str(s.get("new_tokens", "")),
                         _fmt(s.get("seconds"), ".1f"), _fmt(s.get("tokens_per_second"), ".2f"),
                         _fmt(s.get("speedup_vs_ar"), ".2f") + ("×" if s.get("speedup_vs_ar") else ""),
                         _accepted(s.get("mean_accepted") or {})])
    return rows


def print_report(report: dict[str, Any], console: Any = None) -> None:
    """The table (rich), then mismatches, not-applicable modes and forward times."""
    from rich.console import Console
    from rich.table import Table

    if console is None:  # a pipe or a log file gets a wide table instead of rich's 80-column default
        console = Console() if sys.stdout.isatty() else Console(width=150)
    if report.get("overall"):
        table = Table(title="polyspec bench (tokens/s = new tokens / seconds; mean accepted = tokens per forward)")
        for col in ("category", "mode", "gens", "tokens", "seconds", "tok/s", "vs ar", "mean accepted per level"):
            table.add_column(col, justify="left" if col in ("category", "mode", "mean accepted per level") else "right")
        last = None
        for row in report_rows(report):
            if last is not None and row[0] != last:
                table.add_section()
            last = row[0]
            table.add_row(*row)
        console.print(table)
        mism = report.get("mismatches") or []
        console.print(f"mismatches vs {report.get('reference_mode')}: {len(mism)} ({report.get('mismatch_check')})")
        for m in mism[:20]:
            console.print(f"  {m['mode']} {m['category']} {m['question_id']} turn {m['turn']}: first differs at "
                          f"token {m['first_difference_at']} ({m['mode_tokens']} vs {m['reference_tokens']} tokens)")
        for mode, why in (report.get("not_applicable") or {}).items():
            console.print(f"{mode}: not applicable — {why}")
    ft = report.get("forward_times")
    if ft:
        table = Table(title=f"one forward, ms (median of {ft['repeats']}, {ft['prefix']} cached tokens); "
                            "ratio to the target at the same T")
        table.add_column("level")
        table.add_column("kind")
        for w in ft["widths"]:
            table.add_column(f"T={w} ms", justify="right")
            table.add_column(f"T={w} ratio", justify="right")
        for name, lv in ft["levels"].items():
            cells = []
            for w in ft["widths"]:
                cells += [f"{lv['ms'][str(w)]:.2f}", f"{ft['ratio_to_target'][name][str(w)]:.3f}"]
            table.add_row(name, lv["kind"], *cells)
        console.print(table)
    rl = report.get("roofline")
    if rl:
        line = (f"memory roofline of the target: {rl.get('streamed_bytes', rl['weight_bytes']) / 1e6:.0f} MB of "
                f"weights per decode step at {rl['bandwidth_GBps']:.1f} GB/s (a GEMV's stream) -> at most "
                f"{rl['roofline_tokens_per_second']:.1f} tokens/s at batch 1")
        if rl.get("fraction_of_roofline") is not None:
            line += (f"; ar reaches {rl['measured_tokens_per_second']:.2f} tokens/s = "
                     f"{100 * rl['fraction_of_roofline']:.0f}% of it")
        console.print(line)


def write_json(report: dict[str, Any], path: Path) -> Path:
    return fsutil.write_json(path, report, indent=2, default=str)


def write_plots(report: dict[str, Any], path: Path) -> list[Path]:
    """``path``: speedup over ar by category and mode; ``<stem>_accept<suffix>``: acceptance-length histograms."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    written = []
    cats = [*sorted(report["by_category"]), "overall"]
    blocks = {**report["by_category"], "overall": report["overall"]}
    modes = [m for m in report["overall"] if m != "ar" and not report["overall"][m].get("not_applicable")]
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * len(cats) + 2), 4.0))
    width = 0.8 / max(len(modes), 1)
    for j, mode in enumerate(modes):
        ys = [blocks[c].get(mode, {}).get("speedup_vs_ar") or 0.0 for c in cats]
        ax.bar([i + (j - (len(modes) - 1) / 2) * width for i in range(len(cats))], ys, width, label=mode)
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_xticks(range(len(cats)), cats, rotation=20, ha="right")
    ax.set_ylabel("speedup over ar (tokens/s ratio)")
    ax.set_title("polyspec bench: speedup by category and mode")
    if modes:
        ax.legend()
    fig.tight_layout()
    written.append(fsutil.atomic_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png")))
    plt.close(fig)

    hists = [(m, lv, h) for m, d in (report.get("acceptance_histograms") or {}).items() for lv, h in d.items()]
    n = max(len(hists), 1)
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n, 3.2), squeeze=False)
    for ax, (mode, level, h) in zip(axes[0], hists, strict=False):
        xs = sorted(int(k) for k in h)
        total = sum(h.values())
        mean = sum(int(k) * v for k, v in h.items()) / total if total else 0.0
        ax.bar(xs, [h[k] if k in h else h[str(k)] for k in xs], color="tab:blue")
        top = max(xs) if xs else 1
        ax.set_xticks(range(1, top + 1) if top <= 16 else range(1, top + 1, max(1, top // 8)))
        ax.set_xlim(0.4, top + 0.6)
        ax.set_title(f"{mode}: {level} (mean {mean:.2f})", fontsize=9)
        ax.set_xlabel("tokens emitted per verification")
        ax.set_ylabel("count")
    if not hists:
        axes[0][0].text(0.5, 0.5, "no speculative mode ran", ha="center", va="center")
        axes[0][0].set_axis_off()
    fig.tight_layout()
    accept = path.with_name(f"{path.stem}_accept{path.suffix or '.png'}")
    written.append(fsutil.atomic_file(accept, lambda tmp: fig.savefig(tmp, dpi=120, format="png")))
    plt.close(fig)
    return written
