"""A profile on disk: ``profile.json`` (format :data:`~polyspec.export.results.PROFILE_FORMAT`), the stamped tables,
the verdict table as Markdown and the two plots, written as one folder atomically; and reading it back. A chain
search (:mod:`polyspec.export.search`) is written apart: ``search.json`` and ``search.md`` (:func:`write_search`).

Folder layout::

    profile.json            the whole :class:`~polyspec.export.results.Profile`, with the software/hardware stamps
    tables/*.json           costs, acceptance, grid, verdict, speedup, variance: each with the same stamps
    verdict.md              the verdict table (what ``make demo`` prints)
    insertion_region.png    per insertion: cond1 / cond2 / exact boundaries with every candidate as a point
    acceptance_hist.png     acceptance-length distributions with the exact min(G, n) pmf at the fitted alpha
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from polyspec.chain_spec import DraftSpec
from polyspec.errors import PolyspecError
from polyspec.export.results import PROFILE_FORMAT, Insertion, Profile, Search, from_json, to_json
from polyspec.fsutil import atomic_folder

PROFILE_JSON = "profile.json"


def write_json(path: Path, data: Any) -> Path:
    """``data`` as indented JSON at ``path``, through a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(json.dumps(data, indent=1, default=str) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def summary_L(p: Profile) -> dict[str, Any]:
    """The first insertion's acceptance lengths and betas, and L per verifier of the chosen chain (the manifest's
    ``measurements.L``; for three levels the only insertion)."""
    v, chain = p.insertions[0], p.final["chain"]
    return {"L_i": v.inputs.L_i, "L_new": v.inputs.L_new, "L_i_new": v.inputs.L_i_new,
            "beta_dual": p.final["dual_at_chain_k"].beta, "beta_chain": chain.beta,
            "chain": {nm: chain.per_level[nm].L for nm in chain.levels[:-1]}, "draft": v.draft, "mu": v.mu}


def verdict_json(v: Insertion) -> dict[str, Any]:
    """One insertion's verdict without its candidates (listed apart)."""
    return {k: x for k, x in to_json(v).items() if k != "candidates"}


# ---------------------------------------------------------------------------------------------------------------------
# verdict.md


def _why_ar(p: Profile) -> str:
    dec = p.decision
    why = [w for w, flag in (("predicted", dec.ar_predicted_faster), ("measured", dec.ar_measured_faster)) if flag]
    return "plain decoding is " + " and ".join(why) + " faster here" if why else "plain decoding"


def _insertion_rows(p: Profile, v: Insertion) -> list[str]:
    """Theorem 3.2 and Lemma 3.1 for one insertion (for three levels, exactly the rows of earlier formats)."""
    t, i = p.tags, v.inputs
    before = p.final[v.before_run]
    dual = v.before_run == "dual_at_chain_k"
    where = f"dual {v.draft}" if dual else f"without {t[v.level]} {v.draft} mu={v.mu}"
    beta_before = before.betas[before.levels.index(v.above)] or 0.0
    rows = [] if len(p.insertions) == 1 else [f"| insertion of {t[v.level]} between {t[v.above]} and {t[v.below]} "
                                              f"| pays: {v.pays} |"]
    return rows + [
        f"| T_{t[v.above]} / T_{t[v.level]} / T_{t[v.below]} (ms, chain widths) | {i.T_i * 1e3:.2f} / "
        f"{i.T_new * 1e3:.2f} / {i.T_next * 1e3:.2f} |",
        f"| L_i ({t[v.above]} over {t[v.below]}, {where}) | {i.L_i:.3f} |",
        f"| L_new ({t[v.level]} over {t[v.below]}, {v.draft}) | {i.L_new:.3f} |",
        f"| L_i_new ({t[v.above]} over {t[v.level]} blocks, mu={v.mu}) | {i.L_i_new:.3f} |",
        f"| beta ({'dual' if dual else 'without ' + t[v.level]} / chain) | {beta_before:.2f} / "
        f"{(p.final['chain'].beta or 0):.2f} |",
        f"| cond1: T_new/T_i < L_new(1/L_i - 1/L_i_new) | {v.cond1_lhs:.3f} < {v.cond1_rhs:.3f}: {v.cond1_holds} |",
        f"| cond2: T_new/T_next < beta(L_new/L_i - 1) | {v.cond2_lhs:.3f} < {v.cond2_rhs:.3f}: {v.cond2_holds} |",
        f"| valid regime L_i_new > L_new > L_i | {v.valid_regime} |",
        f"| Lemma 3.1 ms/token before -> after | {v.time_before * 1e3:.2f} -> {v.time_after * 1e3:.2f} "
        f"(pays: {v.pays}) |",
    ]


def _chosen_row(p: Profile) -> str:
    dec = p.decision
    why = f" ({_why_ar(p)}); best speculative: {dec.speculative_mode}" if dec.mode == "ar" else ""
    how = DraftSpec.model_validate(dec.draft).text()
    return f"| chosen | {dec.mode}{why}, draft {how}, mu={dec.mu} |"


def _needed_row(p: Profile) -> list[str]:
    """What dual's L would have to be for it to match ar and to reach 1.5x ar, by Lemma 3.1 at the measured T and beta
    (T/N = (T_target + beta T_draft) / L against T_target(1)): the bound that says why ar wins where it does."""
    dual, ar = p.final.get("dual"), p.final.get("ar")
    if dual is None or ar is None or dual.predicted is None or ar.predicted is None or len(dual.predicted.T) != 2:
        return []
    pd = dual.predicted
    per_verification = pd.T[0] + (pd.beta or 0.0) * pd.T[1]
    need = per_verification / ar.predicted.T[0]
    return [f"| L needed by dual ({dual.label}) to match ar / to reach 1.5x ar (Lemma 3.1: (T_target + beta T_draft) "
            f"/ T_ar) | {need:.2f} / {1.5 * need:.2f} (measured L {pd.L_eff[0]:.2f}) |"]


def _same_as_dual(p: Profile, name: str) -> bool:
    return name == "dual_at_chain_k" and p.final[name].label == p.final["dual"].label


def _run_rows(p: Profile) -> list[str]:
    """Speedups over dual (dual over itself is 1 by definition), tokens/s, the variance checks."""
    rows = []
    for name, row in p.speedup["wall"].configs.items():
        if name == "dual" or _same_as_dual(p, name):
            continue
        steady = p.speedup["steady"].configs.get(name)
        rows.append(f"| speedup {name} over dual: predicted / measured (wall) / measured (steady) | "
                    f"{row.predicted:.3f} / {row.measured:.3f} / "
                    f"{steady.measured if steady else float('nan'):.3f} |")
    rows += [f"| tokens/s {name} ({c.label}) | {c.tokens_per_second:.2f} |" for name, c in p.final.items()
             if not _same_as_dual(p, name)]
    rows += [f"| Var[accept] {name} (n={vc.n}{', approx.' if vc.approximate else ''}): measured / exact at "
             f"alpha={vc.alpha:.3f} | {vc.var_measured:.3f} / {vc.var_theory:.3f} |"
             for name, vc in p.variance.items() if vc.count]
    return rows


def _lossless_line(lossless: bool, device: str, dtype: str) -> str:
    """The greedy equality check, with what a failure means where it is expected (16-bit on CUDA)."""
    line = f"Lossless (greedy outputs identical across ar/dual/chain): {lossless}"
    if lossless:
        return line
    if device.startswith("cuda") and dtype in ("bfloat16", "float16"):
        return line + (f" (expected in {dtype} on CUDA: a verification's rows take other GEMM kernels than a decode "
                       "step, so near-ties can flip; the chain is exact in float32: docs/DECODE.md)")
    return line + " (not expected on this device and dtype: please report it with this folder's manifest)"


def verdict_markdown(p: Profile) -> str:
    """The verdict table: T, L, both conditions per insertion, predicted and measured speedups, with the stamps."""
    hw, sw = p.stamps.get("hardware", {}), p.stamps.get("software", {})
    lines = [f"Chain profile ({p.device}, {p.dtype}, {p.prompts.count} prompts x {p.prompts.max_new_tokens} tokens, "
             f"KV length {p.kv_length})", "", "| quantity | value |", "|---|---|"]
    for v in p.insertions:
        lines += _insertion_rows(p, v)
    lines += [_chosen_row(p), *_needed_row(p), *_run_rows(p)]
    lines += ["", _lossless_line(p.lossless_greedy, str(p.device), str(p.dtype)),
              f"Hardware: {hw.get('cpu')}, {hw.get('logical_cores')} cores, CUDA "
              f"{'yes' if (hw.get('cuda') or {}).get('available') else 'no'}; load average "
              f"{p.stamps.get('load_average_before')} -> {p.stamps.get('load_average')}",
              f"Software: polyspec {sw.get('polyspec')} (git {str(sw.get('git_sha'))[:12]}"
              f"{', dirty' if sw.get('git_dirty') else ''}), torch {sw.get('packages', {}).get('torch')}"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------------------
# The folder


def tables(p: Profile) -> dict[str, Any]:
    """The tables/*.json contents (each gets the stamps on top)."""
    return {
        "costs": {"kv_length": p.kv_length, "warmup": p.warmup, "repeats": p.repeats, "levels": to_json(p.costs)},
        "acceptance": {"L": summary_L(p), "final": {k: {"label": c.label, "per_level": to_json(c.per_level),
                                                        "betas": c.betas} for k, c in p.final.items()}},
        "grid": {"rows": to_json(p.grid), "decision": to_json(p.decision)},
        "verdict": {"insertions": to_json(p.insertions)},
        "speedup": to_json(p.speedup),
        "variance": to_json(p.variance),
    }


def _plots(p: Profile, folder: Path) -> None:
    from polyspec.export.plots import plot_acceptance_histograms, plot_insertion_regions
    from polyspec.export.profile import acceptance_checks

    plot_insertion_regions(p.insertions, p.tags, folder / "insertion_region.png")
    series = []
    for key, label, run, level in acceptance_checks(p):
        vc = p.variance.get(key)
        series.append({"label": label, "hist": p.final[run].per_level[level].accept_hist or {},
                       "n": vc.n if vc else None, "alpha": vc.alpha if vc else None})
    plot_acceptance_histograms(series, folder / "acceptance_hist.png")


def write_profile(out_dir: Path, p: Profile) -> Path:
    """profile.json, tables/*.json (each stamped), verdict.md and the two plots, written as one folder atomically
    with the files' hashes (checked before the profile is reused)."""

    def write(tmp: Path) -> None:
        write_json(tmp / PROFILE_JSON, to_json(p))
        for name, table in tables(p).items():
            write_json(tmp / "tables" / f"{name}.json", {"stamps": p.stamps, **table})
        (tmp / "verdict.md").write_text(verdict_markdown(p), encoding="utf-8")
        _plots(p, tmp)

    return atomic_folder(out_dir, write, hashes=True)


def read_profile(folder: Path) -> Profile | None:
    """The profile stored in ``folder`` (None when there is none or it is unreadable, e.g. half-copied).

    A profile of another format is an error that says to profile again."""
    path = Path(folder) / PROFILE_JSON
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    fmt = raw.get("format") if isinstance(raw, dict) else None
    if fmt != PROFILE_FORMAT:
        raise PolyspecError(f"{path} is profile format {fmt}; this polyspec reads format {PROFILE_FORMAT}: rerun the "
                            "profile stage (polyspec profile RECIPE) to measure the chain again")
    p = from_json(Profile, raw)
    p.path = str(folder)
    return p


# ---------------------------------------------------------------------------------------------------------------------
# The chain search: search.json and search.md

SEARCH_JSON = "search.json"


def _ms(x: float | None) -> str:
    return f"{x * 1e3:.3f}" if x is not None else "n/a"


def _verdict_cells(v: Insertion | None) -> str:
    if v is None:
        return "n/a | n/a | n/a"
    return (f"{v.cond1_lhs:.3f} < {v.cond1_rhs:.3f}: {v.cond1_holds} | {v.cond2_lhs:.3f} < {v.cond2_rhs:.3f}: "
            f"{v.cond2_holds} | {v.valid_regime}")


def _tps(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def search_markdown(s: Search) -> str:
    """The search's tables: drafts, every insertion tried, predicted vs measured for the confirmed chains, the
    decision."""
    lines = [f"Chain search ({s.device}, {s.dtype}, {s.prompts.count} prompts ({s.prompts.grid_count} in the runs "
             f"that search) x {s.prompts.max_new_tokens} tokens, {s.runs} runs)", "",
             "| draft under the target | draft | predicted ms/token | measured tok/s (grid) |", "|---|---|---|---|"]
    lines += [f"| {p.levels[-1]} | {p.draft} | {_ms(p.predicted_time_per_token_s)} | "
              f"{p.measured_tokens_per_second:.2f} |" for p in s.drafts]
    lines += ["", "| round | chain before | inserted at | draft | mu | Lemma 3.1 ms/token before -> after | "
              "measured tok/s before -> after (grid) | pays | cond1 | cond2 | valid regime |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {t.round} | {'<-'.join(t.before)} | {t.inserted} @ {t.position} | {t.draft} | {t.mu} | "
              f"{_ms(t.time_before_s)} -> {_ms(t.time_after_s)} | {_tps(t.measured_tokens_per_second_before)} -> "
              f"{_tps(t.measured_tokens_per_second_after)} | {t.pays} | {_verdict_cells(t.verdict)} |"
              for t in s.insertions]
    lines += ["", f"Greedy chain: {'<-'.join(s.greedy_chain.levels)} (stopped: {s.stop_reason})", "",
              "| confirmed (all prompts) | draft | mu | predicted ms/token (grid / all) | predicted tok/s | "
              "measured tok/s (wall / steady) | greedy = ar |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {'<-'.join(c.levels)} | {c.draft} | {c.mu} | {_ms(c.predicted_grid_s)} / {_ms(c.predicted_s)} | "
              f"{c.predicted_tokens_per_second or float('nan'):.2f} | "
              f"{c.tokens_per_second:.2f} / {c.tokens_per_second_steady:.2f} | {c.lossless_greedy} |"
              for c in [*s.confirmed, s.ar]]
    d = s.decision
    lines += ["", f"Decision: {d.mode} {'<-'.join(d.levels)} draft {d.draft} mu={d.mu} (ar predicted faster: "
              f"{d.ar_predicted_faster}, ar measured at least as fast: {d.ar_measured_faster})", f"Rule: {d.rule}"]
    return "\n".join(lines) + "\n"


def read_search(folder: Path) -> Search | None:
    """The search stored in ``folder`` (None when there is none, it is unreadable or of another format)."""
    try:
        raw = json.loads((Path(folder) / SEARCH_JSON).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if not isinstance(raw, dict) or raw.get("format") != Search.format:
        return None
    s = from_json(Search, raw)
    s.path = str(folder)
    return s


def write_search(out_dir: Path, s: Search) -> Path:
    """search.json and search.md, written as one folder atomically with the files' hashes."""

    def write(tmp: Path) -> None:
        write_json(tmp / SEARCH_JSON, to_json(s))
        (tmp / "search.md").write_text(search_markdown(s), encoding="utf-8")

    return atomic_folder(out_dir, write, hashes=True)
