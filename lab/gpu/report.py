"""``python lab/gpu/report.py OUT``: the GPU check's results in a few lines (the last lines of a call's output, and
what docs/GPU.md says to record in docs/GPU_RESULTS.md). Reads whatever step JSONs are in OUT; stdlib only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(out: Path, name: str) -> dict[str, Any] | None:
    try:
        return json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None


def status(r: dict[str, Any] | None) -> str:
    if r is None:
        return "no JSON"
    c = r.get("check") or {}
    tail = " TIMED OUT" if c.get("timed_out") else ("" if c.get("rc") == 0 else f" rc={c.get('rc')}")
    return f"{c.get('seconds', '?')}/{c.get('limit', '?')} s{tail}" + (f", {r['error']}" if "error" in r else "")


def lines(out: Path) -> list[str]:
    rows = []
    env = load(out, "env")
    if env and "versions" in env:
        v = env["versions"]
        rows.append(f"device: {v.get('gpu') or 'cpu'}; torch {v.get('torch')} (CUDA {v.get('torch_cuda')}), "
                    f"triton {v.get('triton')}")
    rows += tests_line(out, "a_tests", "a")
    b = load(out, "b_kernel_ab")
    if b is not None:
        rows.append(f"b kernel A/B [{status(b)}]: time / bf16 (GB/s) by shape, rows")
        for r in b.get("results", []):
            if r["backend"] != "bf16" and "vs_bf16" in r:
                rows.append(f"  {r['n']}x{r['k']} M={r['rows']:<2} {r['backend']:<16} {r['vs_bf16']:.3f} "
                            f"({r['GBps']:.0f} GB/s)")
        rows += [f"  {k}: {v}" for k, v in (b.get("not_run") or {}).items()]
    c = load(out, "c_shape_bench")
    if c is not None:
        rows.append(f"c shape-bench [{status(c)}]")
        if "roofline" in c:
            roof = c["roofline"]
            rows.append(f"  ar {c['ar']['tokens_per_second']:.1f} tok/s = {roof['fraction_of_roofline']:.1%} of the "
                        f"roofline; int4/target " + ", ".join(f"W={w} {x:.3f}" for w, x in c["int4_ratio"].items()))
            head = c["forward_times"]["ratio_to_target"].get("draft", {})
            rows.append("  head/target " + ", ".join(f"W={w} {x:.3f}" for w, x in head.items()))
    d = load(out, "d_projection")
    if d is not None:
        rows.append(f"d projection [{status(d)}]")
        for p in d.get("paper_projection", []):
            rows.append(f"  Lemma 3.1 with the paper's L {p['L']}: {p['projected_speedup_vs_ar']:.2f}x ar")
        ch = (d.get("replay") or {}).get("chain")
        if ch:
            rows.append(f"  replay: L {', '.join(f'{x:.2f}' for x in ch['L_measured'])}: measured "
                        f"{ch['speedup_vs_ar_measured']:.2f}x, Lemma 3.1 {ch['speedup_vs_ar_lemma']:.2f}x, measured / "
                        f"lemma {ch['measured_over_lemma']:.3f}, follows the script {ch['follows_script']}")
            if "draft_vocab" in d:
                v = d["draft_vocab"]
                rows.append(f"  head with a {v['size']}-token draft vocabulary: {v['T_ms']:.3f} ms = "
                            f"{v['ratio_to_target']:.3f} of the target's step")
            if "host_ms_per_token" in ch:
                rows.append(f"  replay per token: the decoder's passes {ch['passes_ms_per_token']:.3f} ms, the host "
                            f"{ch['host_ms_per_token']:.3f} ms, Lemma 3.1 {ch['lemma_ms_per_token']:.3f} ms")
    rows += sweep_lines(load(out, "i_int4_sweep"))
    for name in ("e_assemble", "f_bench_fp32", "g_bench_bf16"):
        r = load(out, name)
        if r is not None:
            rows.append(f"{name} [{status(r)}]" + bench_line(r))
    return rows + tests_line(out, "h_tests", "h")


def sweep_lines(i: dict[str, Any] | None) -> list[str]:
    if i is None:
        return []
    rows = [f"i int4 plans [{status(i)}]" + (f": {i['not_run']}" if "not_run" in i else "")]
    for r in i.get("results", []):
        tail = r.get("error") or f"{r['ms_per_layer'] * 1e3:.2f} us, {r['GBps']:.0f} GB/s, err {r['rel_err']:.1e}"
        rows.append(f"  {r['n']}x{r['k']} rows {r['rows']} {r['plan']}: {tail}")
    return rows


def tests_line(out: Path, name: str, letter: str) -> list[str]:
    t = load(out, name)
    if t is None:
        return []
    return [f"{letter} tests [{status(t)}]: {t.get('counts', {})}"
            + "".join(f"\n  FAILED {f['test']}: {f['message'][:160]}" for f in t.get("failed", []))]


def bench_line(r: dict[str, Any]) -> str:
    overall = (r.get("overall") or {}) if isinstance(r.get("overall"), dict) else {}
    parts = [f"{m} {v.get('tokens_per_second', 0):.1f} tok/s ({v.get('speedup_vs_ar', 0):.2f}x)"
             for m, v in overall.items() if isinstance(v, dict)]
    if "mismatches" in r:
        parts.append(f"mismatches {len(r['mismatches'])}")
    return (": " + ", ".join(parts)) if parts else ""


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    print("\n".join(lines(Path(argv[0]))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
