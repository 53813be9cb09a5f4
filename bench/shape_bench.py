"""``polyspec shape-bench``: timings of random-weight models at a named shape (Llama-2-7B by default).

What the GPU items of issues 3 and 7 ask for, in one command:

* **AR against the memory roofline.** A random-weight target at the shape (bf16 on a GPU), decoded greedily by our
  engine (CUDA graphs on a GPU) for ``--new-tokens`` tokens, several times: tokens/s, and the fraction of the
  batch-1 roofline (measured read bandwidth / weight bytes, :mod:`polyspec.bench.roofline`) it reaches.
* **int4 g128 relative to the full-precision target.** A copy of the shape with random GPTQ-layout int4 codes in
  every q/k/v/o/gate/up/down (embeddings, norms and lm_head stay in the compute dtype, as GPTQ leaves them), and a
  random EAGLE head; the median forward time of each level at each width (1 = a decode step, k + 1 and mu + 1 =
  verifications), interleaved, relative to the target at the same width.
* **A Lemma 3.1 projection** (``--chain``): the acceptance lengths a real chain measured when it was profiled (its
  manifest's ``measurements.grid``: L_eff per level and beta per configuration) combined with these T_i, giving the
  speedup over ``ar`` each configuration would have at this shape. It is labelled a projection: the acceptance of a
  small model's chain stands in for a 7B chain's.

Weights are random (timing only): decode speed does not depend on the values. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyspec.device import DTYPE_NAMES
from polyspec.errors import PolyspecError

# Architectures (Hugging Face configs of the public checkpoints); "tiny" is for tests.
SHAPES: dict[str, dict[str, Any]] = {
    "llama2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                      num_kv_heads=32, head_dim=128, rms_norm_eps=1e-5, max_position_embeddings=4096),
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                      num_kv_heads=8, head_dim=128, rope_theta=500000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, max_position_embeddings=1024),
}
# The paper's measured speedups of its chain at 7B (Wang et al., ICML 2025), for the side-by-side.
PAPER_SPEEDUPS = {"Vicuna-7B": 3.48, "LLaMA2-Chat-7B": 3.66}
PAPER_INT4_RATIO = 0.318


def shape_args(name: str):
    from polyspec.decode.model import ModelArgs

    if name not in SHAPES:
        raise PolyspecError(f"unknown shape {name!r}; known shapes: {', '.join(SHAPES)}")
    return ModelArgs(model_type="llama", **SHAPES[name])


def _fill(module: Any, gen: Any, std: float = 0.02) -> None:
    """Random values in place: norms 1, floating weights N(0, std), int4 codes uniform, scales ~std/4.6, zeros 8."""
    import torch

    from polyspec.decode.int4 import Int4Linear

    for mod in module.modules():
        if isinstance(mod, Int4Linear):
            mod.qdata.copy_(torch.randint(0, 256, mod.qdata.shape, generator=gen, device=gen.device,
                                          dtype=torch.int32).to(torch.uint8))
            mod.scales.fill_(std / 4.6)  # codes - 8 have std ~4.6: dequantised weights ~N-ish(0, std)
            mod.zeros.fill_(8)
            if mod.bias is not None:
                mod.bias.zero_()
            mod.reset_kernels()
    for name, p in module.named_parameters():
        if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif name.endswith("bias"):
            p.data.zero_()
        else:
            p.data.normal_(0.0, std, generator=gen)


def random_model(args: Any, *, dtype: Any, device: Any, seed: int = 0, int4_group: int | None = None):
    """A Transformer of ``args`` with random weights on ``device`` (built on the meta device first: no fp32 copy);
    ``int4_group``: every q/k/v/o/gate/up/down an Int4Linear with random codes and that group size."""
    import torch

    from polyspec.decode.int4 import Int4Linear, _iter_quantizable, set_embed_dtype
    from polyspec.decode.model import Transformer, rope_inv_freq

    dev = torch.device(device)
    with torch.device("meta"):
        model = Transformer(args).to(dtype)
        if int4_group:
            for block, attr, _ in _iter_quantizable(model):
                lin = getattr(block, attr)
                n, k = lin.weight.shape
                g = -(-k // int4_group)
                setattr(block, attr, Int4Linear(torch.zeros(n, k, dtype=torch.uint8), torch.ones(n, g),
                                                torch.zeros(n, g, dtype=torch.uint8), int4_group))
    model = model.to_empty(device=dev)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.inv_freq = rope_inv_freq(args).to(dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        _fill(model, gen)
    if int4_group and dtype == torch.float32:  # as load_int4 keeps them: 16-bit embedding / lm_head (W4A16)
        set_embed_dtype(model, torch.bfloat16)
    return model.requires_grad_(False).eval()


def random_head(args: Any, target: Any, *, dtype: Any, seed: int = 1):
    """A random EAGLE head at ``args`` sharing ``target``'s embedding and lm_head."""
    import torch
    from torch import nn

    from polyspec.decode.head import EagleHead
    from polyspec.decode.model import Linear, rope_inv_freq

    dev = target.embed_tokens.weight.device
    with torch.device("meta"):
        head = EagleHead(args, nn.Embedding(args.vocab_size, args.hidden_size),
                         Linear(args.hidden_size, args.vocab_size, bias=False)).to(dtype)
    head = head.to_empty(device=dev)
    gen = torch.Generator(device=dev).manual_seed(seed)
    with torch.no_grad():
        _fill(head, gen)
    head.embed_tokens, head.lm_head = target.embed_tokens, target.lm_head
    head.inv_freq = rope_inv_freq(args).to(dev)
    return head.requires_grad_(False).eval()


@dataclass
class ShapeChain:
    """What :func:`polyspec.bench.bench.forward_times` needs from a loaded chain."""

    models: dict[str, Any]
    order: list[str] = field(default_factory=lambda: ["target", "intermediate", "draft"])
    kinds: dict[str, str] = field(default_factory=lambda: {"target": "target", "intermediate": "int4",
                                                           "draft": "head"})


def ar_speed(target: Any, *, prompt_len: int, new_tokens: int, repeats: int, seed: int = 0) -> dict[str, Any]:
    """Greedy ``ar`` decoding with our engine: tokens/s per repeat (after one warm-up generation), and the median;
    the prompt's prefill is timed apart and left out of the decode rate. Each generation is followed by the same
    number of bare one-token forwards (the model alone, no decoding loop), so the two rates share a time window."""
    import torch

    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import ModelLevel
    from polyspec.decode.timing import timed

    dev = target.inv_freq.device
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, target.args.vocab_size, (prompt_len,), generator=gen).tolist()
    level = ModelLevel(target, "target")
    dec = ChainDecoder([level], max_seq_len=prompt_len + new_tokens + 8)
    runs, steps = [], []
    for r in range(repeats + 1):
        res, _ = timed(lambda: dec.generate(prompt, new_tokens), dev)
        step = _step_seconds(target, prompt, len(res.token_ids))
        if r:
            runs.append((len(res.token_ids), float(res.stats["seconds"])))
            steps.append(step)
    # generate() prefills prompt[:-1] in one forward, then runs one decode step per new token: the decode rate
    # leaves out that prefill, timed on its own (median of a few).
    prefill = statistics.median(_prefill_seconds(target, prompt[:-1]) for _ in range(3)) if prompt_len > 1 else 0.0
    total = [n / s for n, s in runs]
    decode = [n / max(s - prefill, 1e-9) for n, s in runs]
    return {"prompt_tokens": prompt_len, "new_tokens": new_tokens, "repeats": repeats,
            "tokens_per_second_runs": total, "tokens_per_second_end_to_end": statistics.median(total),
            "prefill_seconds": prefill, "decode_tokens_per_second_runs": decode,
            "tokens_per_second": statistics.median(decode),
            "step_tokens_per_second": statistics.median(1.0 / s for s in steps)}


def _step_seconds(model: Any, prompt: list[int], n: int) -> float:
    """Median seconds of ``n`` bare one-token forwards after the prompt (the decode step without the loop)."""
    import torch

    from polyspec.decode.timing import timed

    dev = model.inv_freq.device
    model.setup_cache(len(prompt) + n + 8)
    ids = torch.tensor(prompt, device=dev)
    one = torch.tensor([1], device=dev)
    with torch.inference_mode():
        model(ids)
        return statistics.median(timed(lambda: model(one), dev)[1] for _ in range(max(n, 1)))


def _prefill_seconds(model: Any, prompt: list[int]) -> float:
    import torch

    from polyspec.decode.timing import timed

    dev = model.inv_freq.device
    model.setup_cache(len(prompt) + 8)
    ids = torch.tensor(prompt, device=dev)
    with torch.inference_mode():
        return timed(lambda: model(ids), dev)[1]


def _config_widths(cfg: dict[str, Any], tree: dict[str, int] | None) -> dict[str, int] | None:
    """Forward width of each level in one profiled configuration (None: not projectable)."""
    mode, k, mu = cfg.get("mode"), cfg.get("draft_k"), list(cfg.get("mu") or [])
    is_tree = "tree" in str(cfg.get("label", ""))
    if is_tree and not tree:
        return None
    if mode == "dual":
        verify = tree["total_tokens"] + 1 if is_tree else k + 1
        return {"target": verify, "draft": tree["top_k"] if is_tree else 1}
    if mode == "chain" and len(mu) == 1:
        verify = tree["total_tokens"] + 1 if is_tree else k + 1
        return {"target": mu[0] + 1, "intermediate": verify, "draft": tree["top_k"] if is_tree else 1}
    return None


def project(measurements: dict[str, Any], ms: dict[str, dict[int, float]]) -> list[dict[str, Any]]:
    """Lemma 3.1 at this shape for every configuration of a chain's profile grid.

    ``measurements``: a chain manifest's ``measurements`` (``grid`` entries with ``mode``, ``draft_k``, ``mu``,
    ``L`` {level name: L_eff}, ``beta``; ``decision.grid.tree``). ``ms``: {"target" | "intermediate" | "draft":
    {width: median ms}}. The chain's level names are mapped by position (top, middle, bottom)."""
    from polyspec.theory import chain_time_per_token

    tree = ((measurements.get("decision") or {}).get("grid") or {}).get("tree")
    ar_ms = ms["target"][1]
    out = []
    for cfg in measurements.get("grid") or []:
        if cfg.get("mode") not in ("dual", "chain"):
            continue
        widths = _config_widths(cfg, tree)
        ls = list((cfg.get("L") or {}).values())
        beta = cfg.get("beta")
        if widths is None or not beta or len(ls) != len(widths) - 1 or min(ls) <= 0:
            continue
        names = list(widths)
        costs = [ms[n][widths[n]] for n in names]
        t = chain_time_per_token(costs, ls, beta)
        out.append({"label": cfg.get("label"), "mode": cfg["mode"], "draft_k": cfg.get("draft_k"),
                    "mu": cfg.get("mu"), "L_eff": ls, "beta": beta,
                    "widths": widths, "T_ms": costs, "time_per_token_ms": t,
                    "projected_speedup_vs_ar": ar_ms / t})
    return sorted(out, key=lambda c: -c["projected_speedup_vs_ar"])


def needed_widths(measurements: dict[str, Any] | None, base: list[int]) -> list[int]:
    ws = set(base) | {1}
    if measurements:
        tree = ((measurements.get("decision") or {}).get("grid") or {}).get("tree")
        for cfg in measurements.get("grid") or []:
            w = _config_widths(cfg, tree)
            if w:
                ws |= set(w.values())
    return sorted(ws)


def _random_levels(args: Any, tdtype: Any, dev: Any, group_size: int, use_graphs: bool,
                   say: Any) -> dict[str, Any]:
    """The shape's random target, its int4 copy and an EAGLE head, packed (and graph-captured where asked)."""
    from polyspec.decode import cpu_kernels, cuda_graphs
    from polyspec.decode.generate import GRAPH_WIDTH

    target = random_model(args, dtype=tdtype, device=dev, seed=0)
    say(f"shape-bench: building its int4 g{group_size} copy and a random EAGLE head")
    int4 = random_model(args, dtype=tdtype, device=dev, seed=1, int4_group=group_size)
    models = {"target": target, "intermediate": int4, "draft": random_head(args, target, dtype=tdtype)}
    for name, m in models.items():
        cpu_kernels.pack_weights(m, int8_inputs=name != "target")
        if use_graphs:
            cuda_graphs.enable(m, graphs=True, max_width=GRAPH_WIDTH)
    return models


def _chain_measurements(chain_dir: Path) -> dict[str, Any]:
    """The profile measurements of a chain folder (for the Lemma 3.1 projection), or one clear error."""
    from polyspec.manifest import read_manifest

    if not chain_dir.is_dir():
        raise PolyspecError(f"--chain {chain_dir}: no such folder; pass a profiled chain folder (the export "
                            "stage's `chain/`, with manifest.json), or leave --chain out to run without the "
                            "Lemma 3.1 projection")
    if not (chain_dir / "manifest.json").is_file():
        raise PolyspecError(f"--chain {chain_dir} has no manifest.json, so there are no measured acceptance "
                            "lengths to project from; pass a chain folder written by `polyspec run` / "
                            "`polyspec export` (e.g. runs/smollm2_cpu/chain), or leave --chain out to run "
                            "without the Lemma 3.1 projection")
    measurements = read_manifest(chain_dir).measurements
    if not measurements or not measurements.get("grid"):
        raise PolyspecError(f"{chain_dir}/manifest.json has no profile measurements (measurements.grid); export "
                            "the chain with `polyspec export` (which profiles it) first")
    return measurements


def run_shape_bench(shape: str, *, device: str = "auto", dtype: str | None = None, new_tokens: int = 128,
                    prompt_len: int = 32, repeats: int = 3, widths: list[int] | None = None,
                    forward_prefix: int = 512, forward_repeats: int = 20, group_size: int = 128,
                    chain_dir: Path | None = None, graphs: bool | None = None, say: Any = None) -> dict[str, Any]:
    """Build the shape's target, int4 copy and head; measure AR speed, the roofline and forward times; project."""
    import torch

    from polyspec.bench.bench import forward_times
    from polyspec.bench.roofline import measure_bandwidth, roofline, weight_bytes
    from polyspec.decode import cpu_kernels, cuda_graphs
    from polyspec.device import resolve_device, resolve_dtype

    say = say or (lambda msg: print(msg, file=sys.stderr))
    measurements = None if chain_dir is None else _chain_measurements(Path(chain_dir))
    dev = resolve_device(device)
    tdtype = resolve_dtype(dtype, dev)
    name = str(tdtype).removeprefix("torch.")
    args = shape_args(shape)
    widths = needed_widths(measurements, widths or [1, 4, 5, 9])
    _check_lengths(shape, args.max_position_embeddings, (prompt_len, new_tokens), forward_prefix, max(widths))
    use_graphs = cuda_graphs.graphs_wanted(dev) if graphs is None else graphs
    if use_graphs and dev.type != "cuda":
        raise PolyspecError("CUDA graphs need --device cuda")
    say(f"shape-bench: building random {shape} target ({name}) on {dev}")
    models = _random_levels(args, tdtype, dev, group_size, use_graphs, say)
    target = models["target"]
    say("shape-bench: memory bandwidth")
    bw = measure_bandwidth(dev)
    say(f"shape-bench: ar, {repeats} x {new_tokens} tokens")
    ar = ar_speed(target, prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats)
    say(f"shape-bench: forward times at widths {widths}")
    ft = forward_times(ShapeChain(models), widths=widths, prefix=forward_prefix, repeats=forward_repeats)
    ms = {n: {int(w): v for w, v in d["ms"].items()} for n, d in ft["levels"].items()}
    step_tps = ar["step_tokens_per_second"]
    roof = roofline(target, bw["median_GBps"], ar["tokens_per_second"])
    roof["decode_step_tokens_per_second"] = step_tps
    roof["decode_step_fraction_of_roofline"] = step_tps / roof["roofline_tokens_per_second"]
    report: dict[str, Any] = {
        "shape": shape, "args": args.to_dict(), "device": str(dev), "dtype": name, "cuda_graphs": use_graphs,
        "compiled_step": bool(use_graphs and cuda_graphs.compile_wanted(dev)),
        "cpu_kernels": cpu_kernels.state() if dev.type == "cpu" else None,
        "weight_bytes": {n: weight_bytes(m) for n, m in models.items()},
        "bandwidth": bw, "ar": ar, "roofline": roof, "forward_times": ft,
        "int4_ratio": {str(w): ms["intermediate"][w] / ms["target"][w] for w in widths},
        "paper": {"int4_ratio": PAPER_INT4_RATIO, "speedups": PAPER_SPEEDUPS},
        "projection": None,
    }
    if measurements is not None:
        report["projection"] = _projection(measurements, Path(chain_dir), ms)
    if dev.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(dev)
    return report


def _check_lengths(shape: str, context: int, tokens: tuple[int, int], forward_prefix: int, width: int) -> None:
    """One clear error where the generation (``tokens``: prompt, new tokens) or the widest timed forward after
    ``forward_prefix`` positions would not fit the shape's ``context``."""
    prompt_len, new_tokens = tokens
    if prompt_len + new_tokens + 8 > context:
        raise PolyspecError(f"prompt ({prompt_len}) + new tokens ({new_tokens}) exceed the {shape} context "
                            f"({context})")
    if forward_prefix + width + 1 > context:
        raise PolyspecError(f"--forward-prefix {forward_prefix} + width {width} exceed the {shape} context")


def _projection(measurements: dict[str, Any], chain_dir: Path, ms: dict[str, dict[int, float]]) -> dict[str, Any]:
    return {
        "label": "projection: this shape's measured T_i with the acceptance lengths the chain measured when it "
                 "was profiled (Lemma 3.1)",
        "chain": str(chain_dir), "profiled_on": {"device": measurements.get("device"),
                                                 "dtype": measurements.get("dtype")},
        "configs": project(measurements, ms),
    }


def print_report(r: dict[str, Any], out: Any = None) -> None:
    out = out or sys.stdout
    roof = r["roofline"]
    p = print
    p(f"shape {r['shape']} on {r['device']} ({r.get('gpu') or 'cpu'}), {r['dtype']}, CUDA graphs "
      f"{'on' if r['cuda_graphs'] else 'off'}, compiled step {'on' if r.get('compiled_step') else 'off'}", file=out)
    p(f"  weights {roof['weight_bytes'] / 1e9:.2f} GB; read bandwidth {roof['bandwidth_GBps']:.1f} GB/s -> roofline "
      f"{roof['roofline_tokens_per_second']:.1f} tok/s", file=out)
    p(f"  ar: {r['ar']['tokens_per_second']:.1f} tok/s = {roof['fraction_of_roofline']:.1%} of the roofline "
      f"(decode step alone: {roof['decode_step_tokens_per_second']:.1f} tok/s = "
      f"{roof['decode_step_fraction_of_roofline']:.1%})", file=out)
    ft = r["forward_times"]["levels"]
    widths = r["forward_times"]["widths"]
    p("  forward ms   " + "  ".join(f"T={w:<5}" for w in widths), file=out)
    for n, d in ft.items():
        p(f"  {n:<12} " + "  ".join(f"{d['ms'][str(w)]:7.3f}" for w in widths), file=out)
    p("  int4/target  " + "  ".join(f"{r['int4_ratio'][str(w)]:7.3f}" for w in widths)
      + f"   (paper: {r['paper']['int4_ratio']})", file=out)
    if r.get("projection"):
        p(f"  {r['projection']['label']}", file=out)
        for c in r["projection"]["configs"][:8]:
            p(f"    {c['label']:<32} L_eff {', '.join(f'{x:.2f}' for x in c['L_eff'])}  beta {c['beta']:.2f}  "
              f"-> {c['projected_speedup_vs_ar']:.2f}x ar", file=out)
        p("  paper (measured at 7B): " + ", ".join(f"{k} {v}x" for k, v in r["paper"]["speedups"].items()), file=out)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("shape", nargs="?", default="llama2-7b", choices=sorted(SHAPES),
                   help="architecture to build with random weights (default llama2-7b)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", choices=DTYPE_NAMES, default=None, help="default: bfloat16 on a GPU, float32 on the CPU")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per ar generation (default 128)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="random prompt length (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="timed ar generations after one warm-up (default 3)")
    p.add_argument("--widths", type=int, nargs="+", default=None,
                   help="forward widths to time (default 1 4 5 9, plus every width the --chain's grid used)")
    p.add_argument("--forward-prefix", type=int, default=512, help="cache length before each timed forward")
    p.add_argument("--forward-repeats", type=int, default=20)
    p.add_argument("--group-size", type=int, default=128, help="int4 group size (default 128)")
    p.add_argument("--chain", type=Path, default=None,
                   help="a profiled chain folder whose measured acceptance lengths feed the Lemma 3.1 projection")
    p.add_argument("--no-cuda-graphs", action="store_true", help="eager forwards on a GPU (for the ablation)")
    p.add_argument("--json", type=Path, default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    for flag in ("new_tokens", "prompt_tokens", "repeats", "forward_repeats", "group_size"):
        if getattr(args, flag) < 1:
            raise PolyspecError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.widths and min(args.widths) < 1:
        raise PolyspecError("--widths must be >= 1")
    if args.forward_prefix < 1:
        raise PolyspecError("--forward-prefix must be >= 1")
    report = run_shape_bench(args.shape, device=args.device, dtype=args.dtype, new_tokens=args.new_tokens,
                             prompt_len=args.prompt_tokens, repeats=args.repeats, widths=args.widths,
                             forward_prefix=args.forward_prefix, forward_repeats=args.forward_repeats,
                             group_size=args.group_size, chain_dir=args.chain,
                             graphs=False if args.no_cuda_graphs else None)
    from polyspec.stamp import command_line, hardware_stamp, software_stamp

    report["command"] = command_line(getattr(args, "command", None))
    report["stamp"] = {"hardware": hardware_stamp(), "software": software_stamp()}
    print_report(report)
    if args.json is not None:
        from polyspec.bench.report import write_json

        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0
