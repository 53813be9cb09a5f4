"""Step i of the GPU check (call 1, last; docs/GPU.md): polyspec's Triton int4 kernel at Llama-2-7B's layer shapes
over launch plans beside the shipped one (``int4_triton.plan``, whose tiles were chosen on the sm_90 compile and
never timed): the column block and the K splits. The 2026-11-29 lease measured the shipped plan at 981 GB/s on the
4096 x 4096 layer at 1 row, a quarter of what the card streams: 32 column blocks of 128 need 8 K splits to fill the
GPU, so each program streams only two blocks of K before an 8-way split-K reduction.

Each variant's output is checked against the shipped plan's on the same input (the same function; split K adds in
another order) and its walk over 8 layers timed as one CUDA graph, as lab/gpu/kernel_ab.py times its backends. A
variant that fails is recorded with its error. No variant is started after ``--budget`` seconds; the JSON is saved
after each one. ``--compile-only`` compiles every variant for sm_90 here instead (registers and spills, no GPU).

    python lab/gpu/int4_sweep.py [--budget 40] --json OUT     # on CUDA; elsewhere the JSON says why not
    python lab/gpu/int4_sweep.py --compile-only               # any machine with triton
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

SHAPES = ((4096, 4096), (12288, 4096), (4096, 11008))  # o, the fused q/k/v, down
ROWS = (1, 16)
# (block_n, K splits), most promising first; 256 columns spill on sm_90 (255 registers, --compile-only, 2026-11-29)
VARIANTS = ((64, 4), (128, 4), (64, 2), (128, 2), (64, 8), (64, 1), (128, 1))
LAYERS = 8


def variant(base: Any, k: int, group: int, block_n: int, splits: int) -> Any:
    """The shipped plan ``base`` with another column block and split count (each split a whole number of blocks)."""
    from polyspec.decode import int4_triton as T

    blocks = T.padded_k(k, group) // (4 * base.units)
    per = -(-blocks // splits)
    return T.Plan(replace(base.tile, block_n=block_n), base.units, -(-blocks // per), per)


def plans(n: int, k: int, group: int, rows: int, sms: int) -> list[tuple[str, Any]]:
    """(label, plan): the shipped plan first, then each variant that differs from it."""
    from polyspec.decode import int4_triton as T

    base = T.plan(n, k, group, rows, sms)
    out = [("shipped", base)]
    for block_n, splits in VARIANTS:
        p = variant(base, k, group, block_n, splits)
        if p != base and all(p != q for _, q in out):
            out.append((f"n{block_n} s{p.splits}", p))
    return out


def describe(p: Any) -> dict[str, Any]:
    t = p.tile
    return {"block_m": t.block_m, "block_n": t.block_n, "warps": t.warps, "stages": t.stages, "splits": p.splits,
            "blocks_per_split": p.blocks_per_split}


def timed_plan(lins: list[Any], xs: list[Any], n: int, p: Any, ref: Any, device: Any) -> dict[str, Any]:
    """One plan's ms per layer and GB/s over the walk, and its output's relative error against ``ref``."""
    import torch
    from kernel_ab import GROUP, walk_ms  # this folder (the script's own, first on sys.path when run)

    from polyspec.decode import int4_triton as T

    try:
        tensors = [lin._triton[(xs[0].device, xs[0].dtype)] for lin in lins]  # Int4Linear's key: the input's device
        with torch.inference_mode():
            y = T.launch(xs[0], tensors[0], GROUP, n, p).float()
        err = float((y - ref).norm() / ref.norm())
        ms = walk_ms(lambda i, x: T.launch(x, tensors[i], GROUP, n, p), xs, device, 20)
    except Exception as exc:  # one plan's failure leaves the sweep standing
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    k = xs[0].shape[1]
    moved = sum(t.codes.numel() * 2 + t.meta.numel() * 4 for t in tensors) + LAYERS * (xs[0].shape[0] * (k + n)) * 2
    return {"ms_per_layer": ms / LAYERS, "GBps": moved / (ms * 1e-3) / 1e9, "rel_err": err}


def sweep(device: Any, budget: float, save: Any, report: dict[str, Any]) -> None:
    import torch
    from kernel_ab import GROUP, int4_layers

    t0 = time.perf_counter()
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    gen = torch.Generator(device=device).manual_seed(0)
    for rows in ROWS:  # at 1 row first: the widths the int4 level verifies most
        for n, k in SHAPES:
            lins = int4_layers(n, k, LAYERS, device, gen)
            xs = [torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16) for _ in range(LAYERS)]
            with torch.inference_mode():
                ref = lins[0](xs[0]).float()  # builds every layer's kernel tensors on first use
                for lin, x in zip(lins[1:], xs[1:], strict=True):
                    lin(x)
            for label, p in plans(n, k, GROUP, rows, sms):
                if time.perf_counter() - t0 > budget:
                    report["skipped"] = report.get("skipped", 0) + 1
                    continue
                row = {"n": n, "k": k, "rows": rows, "plan": label, **describe(p)}
                report["results"].append({**row, **timed_plan(lins, xs, n, p, ref, device)})
                report["seconds"] = time.perf_counter() - t0
                save(report)


def compile_only() -> int:
    from kernel_ab import GROUP

    from polyspec.decode import int4_triton as T

    for (n, k), rows in ((s, r) for r in ROWS for s in SHAPES):
        for label, p in plans(n, k, GROUP, rows, 132):
            res = T.ptxas_resources(T.compile_sm90(n, k, GROUP, rows, plan_=p)[0])
            print(f"{n}x{k} rows {rows} {label:9s} {describe(p)}: {res}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget", type=float, default=40.0, help="seconds after which no variant is started")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--compile-only", action="store_true")
    a = ap.parse_args(argv)
    if a.compile_only:
        return compile_only()
    import torch

    from polyspec.decode import int4_triton as T

    report: dict[str, Any] = {"step": "i_int4_sweep", "shapes": [list(s) for s in SHAPES], "rows": list(ROWS),
                              "layers": LAYERS, "results": []}

    def save(r: dict[str, Any]) -> None:
        if a.json is not None:
            a.json.parent.mkdir(parents=True, exist_ok=True)
            a.json.write_text(json.dumps(r, indent=1))

    if not torch.cuda.is_available() or not T.TRITON:
        report["not_run"] = "needs CUDA and triton (the variants compile here with --compile-only)"
        save(report)
        print(report["not_run"])
        return 0
    device = torch.device("cuda")
    report["gpu"] = torch.cuda.get_device_name(device)
    sweep(device, a.budget, save, report)
    save(report)
    for r in report["results"]:
        tail = r.get("error") or f"{r['ms_per_layer'] * 1e3:7.2f} us  {r['GBps']:6.0f} GB/s  err {r['rel_err']:.1e}"
        print(f"{r['n']}x{r['k']} rows {r['rows']:2d} {r['plan']:9s} {tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
