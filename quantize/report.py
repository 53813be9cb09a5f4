"""How good and how fast the int4 intermediate M2 is, measured against the target M1 with polyspec's own decoder.

* quality on held-out ShareGPT conversations (chat template, next-token prediction at every position):
  perplexity of the target and of each int4 model, top-1 agreement with the target and mean KL(target || int4) per
  token, for GPTQ and for the round-to-nearest baseline;
* L of M2 under M1: greedy speculative decoding with the target verifying blocks of ``draft_k`` tokens drafted by the
  int4 model (:class:`polyspec.decode.chain.ChainDecoder` with two levels); L = tokens emitted per target
  verification (accepted + the correction / bonus token);
* forward time of the int4 model relative to the target on this device at decode shapes (T = 1 and T = draft_k new
  tokens over ``kv_length`` cached positions), on the decoder's int4 kernels.

Run the whole quantize stage (quantise if needed, then this report) for a recipe with
``polyspec quantize recipes/smollm2_demo.yaml``.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from polyspec.decode.timing import timed
from polyspec.errors import PolyspecError

# ---------------------------------------------------------------------------------------------------------------------
# Pure maths


def logit_stats(ref_logits: torch.Tensor, test_logits: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """Sums over T positions (divide by ``tokens`` to get means).

    ref_logits, test_logits: [T, V] (reference = target); targets: [T] next-token ids.
    Returns {tokens, nll_ref, nll_test, agree (top-1 equal), kl (KL(ref || test) in nats)}.
    """
    if ref_logits.shape != test_logits.shape or ref_logits.shape[0] != targets.shape[0]:
        raise PolyspecError(f"logit_stats: shapes {list(ref_logits.shape)} / {list(test_logits.shape)} / "
                            f"{list(targets.shape)} do not match")
    ref = F.log_softmax(ref_logits.float(), dim=-1)  # [T, V]
    test = F.log_softmax(test_logits.float(), dim=-1)  # [T, V]
    tgt = targets.to(ref.device).long()[:, None]  # [T, 1]; targets may be on the CPU beside GPU logits
    kl = (ref.exp() * (ref - test)).sum(-1)  # [T]
    return {
        "tokens": float(targets.shape[0]),
        "nll_ref": float(-ref.gather(1, tgt).sum()),
        "nll_test": float(-test.gather(1, tgt).sum()),
        "agree": float((ref.argmax(-1) == test.argmax(-1)).sum()),
        "kl": float(kl.clamp(min=0).sum()),
    }


def summarize(sums: dict[str, float]) -> dict[str, float]:
    """Sums of :func:`logit_stats` -> {ppl_target, ppl, top1_agreement, mean_kl, tokens}."""
    n = sums["tokens"]
    if n <= 0:
        raise PolyspecError("no tokens were evaluated")
    return {"tokens": int(n), "ppl_target": math.exp(sums["nll_ref"] / n), "ppl": math.exp(sums["nll_test"] / n),
            "top1_agreement": sums["agree"] / n, "mean_kl": sums["kl"] / n}


# ---------------------------------------------------------------------------------------------------------------------
# Measurements with the decoder


@torch.inference_mode()
def quality(target: Any, models: dict[str, Any], sequences: Sequence[Sequence[int]]) -> dict[str, dict[str, float]]:
    """Per model in ``models``: :func:`summarize` of the target-vs-model stats over ``sequences`` (no KV cache)."""
    totals = {name: {"tokens": 0.0, "nll_ref": 0.0, "nll_test": 0.0, "agree": 0.0, "kl": 0.0} for name in models}
    for seq in sequences:
        ids = torch.tensor(list(seq), dtype=torch.long)  # [T]
        for model in (target, *models.values()):
            model.reset()  # no-op without a KV cache (freshly loaded models: whole-sequence forwards)
        ref, _ = target(ids[:-1])  # [T-1, V]
        for name, model in models.items():
            test, _ = model(ids[:-1])  # [T-1, V]
            for k, v in logit_stats(ref, test, ids[1:]).items():
                totals[name][k] += v
    return {name: summarize(s) for name, s in totals.items()}


def acceptance(target: Any, draft: Any, prompts: Sequence[Sequence[int]], draft_k: int, max_new_tokens: int,
               eos_ids: Sequence[int] = ()) -> dict[str, Any]:
    """L of ``draft`` under ``target``: greedy two-level ChainDecoder, tokens emitted per target verification."""
    from polyspec.chain_spec import DraftSpec
    from polyspec.decode.chain import ChainDecoder
    from polyspec.decode.levels import ModelLevel

    longest = max(len(p) for p in prompts) + max_new_tokens + draft_k + 2
    dec = ChainDecoder([ModelLevel(target, "target"), ModelLevel(draft, "int4")], draft=DraftSpec(k=draft_k),
                       max_seq_len=longest)
    lengths: list[int] = []
    tokens = passes = 0
    for prompt in prompts:
        res = dec.generate(list(prompt), max_new_tokens, eos_token_ids=frozenset(eos_ids))
        top = res.level_stats[0]
        lengths.extend(top.accept_lengths)
        tokens += len(res.token_ids)
        passes += top.forward_passes
    if not lengths:
        raise PolyspecError("the acceptance run made no target verification; raise profile.max_new_tokens")
    return {"L": sum(lengths) / len(lengths), "draft_k": draft_k, "verifications": len(lengths), "new_tokens": tokens,
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "target_forward_passes": passes,
            "tokens_per_target_forward": tokens / passes if passes else None}


@torch.inference_mode()
def forward_ms(model: Any, kv_length: int, t: int, repeats: int, warmup: int = 2, seed: int = 0
               ) -> tuple[float, float]:
    """Medians of one forward of ``t`` new tokens over ``kv_length`` cached positions: (wall ms, process CPU ms).

    The CPU time (all threads of this process) is much less sensitive than wall time to other work on the machine.
    """
    vocab = model.args.vocab_size
    g = torch.Generator().manual_seed(seed)
    model.setup_cache(kv_length + t)
    model(torch.randint(0, vocab, (kv_length,), generator=g))  # fill the cache  [kv]
    block = torch.randint(0, vocab, (t,), generator=g)  # [t]
    wall, cpu = [], []
    for i in range(warmup + repeats):
        model.truncate(kv_length)
        c0 = time.process_time()
        _, seconds = timed(lambda: model(block), next(model.parameters()).device)
        if i >= warmup:
            wall.append(seconds * 1000)
            cpu.append((time.process_time() - c0) * 1000)
    model.reset()
    return statistics.median(wall), statistics.median(cpu)


def speed(target: Any, int4: Any, kv_length: int, draft_k: int, repeats: int) -> dict[str, Any]:
    """Forward times (ms, wall and process CPU) of target and int4 at T = 1 and T = draft_k, and int4 / target."""
    import os

    out: dict[str, Any] = {"kv_length": kv_length, "repeats": repeats, "threads": torch.get_num_threads(),
                           "load_average_1m_before": os.getloadavg()[0]}  # other work on the machine skews timings
    for t in sorted({1, draft_k}):
        tw, tc = forward_ms(target, kv_length, t, repeats)
        qw, qc = forward_ms(int4, kv_length, t, repeats)
        out[f"T{t}"] = {"target_ms": tw, "int4_ms": qw, "int4_over_target": qw / tw,
                        "target_cpu_ms": tc, "int4_cpu_ms": qc, "int4_over_target_cpu": qc / tc}
    return out


# ---------------------------------------------------------------------------------------------------------------------
# The whole report


def build_report(target_dir: Any, int4_dirs: dict[str, Any], tokenizer: Any,
                 heldout: Sequence[Sequence[dict[str, str]]], *, device: str = "cpu", dtype: str = "float32",
                 max_length: int = 512, max_sequences: int | None = 16, prompts: int = 8, max_new_tokens: int = 48,
                 draft_k: int = 4, kv_length: int = 256, repeats: int = 5) -> dict[str, Any]:
    """Load the target and every int4 folder of ``int4_dirs`` (name -> folder, the chain's M2 first, e.g.
    {"gptq": ..., "rtn": ...}) into the decoder and measure everything in the module docstring. Speed is measured
    for the first one (all int4 folders run on the same kernels)."""
    from polyspec.decode.model import Transformer
    from polyspec.quantize.calibration import first_user_prompts, heldout_sequences

    if not int4_dirs:
        raise PolyspecError("build_report needs at least one int4 folder")
    from polyspec.device import resolve_dtype

    torch_dtype = resolve_dtype(dtype, device)
    target = Transformer.from_pretrained(target_dir, dtype=torch_dtype, device=device).eval()
    models = {name: Transformer.from_pretrained(d, dtype=torch_dtype, device=device).eval()
              for name, d in int4_dirs.items()}
    primary = next(iter(models))

    t0 = time.perf_counter()
    seqs = heldout_sequences(tokenizer, heldout, max_length, max_sequences)
    qual = quality(target, models, seqs)
    quality_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    eos = [i for i in {tokenizer.eos_token_id} if i is not None]
    chat_prompts = first_user_prompts(tokenizer, heldout, prompts)
    acc = {name: acceptance(target, m, chat_prompts, draft_k, max_new_tokens, eos) for name, m in models.items()}
    acceptance_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    spd = speed(target, models[primary], kv_length, draft_k, repeats)
    speed_s = time.perf_counter() - t0

    report: dict[str, Any] = {
        "device": device,
        "dtype": dtype,
        "primary": primary,
        "heldout": {"sequences": len(seqs), "max_length": max_length, "tokens": qual[primary]["tokens"]},
        "ppl_target": qual[primary]["ppl_target"],
    }
    for name in models:
        report[name] = {**{k: v for k, v in qual[name].items() if k not in ("ppl_target", "tokens")},
                        "L": acc[name]["L"]}
    report.update({"acceptance": acc, "speed": spd,
                   "seconds": {"quality": quality_s, "acceptance": acceptance_s, "speed": speed_s}})
    if "gptq" in models and "rtn" in models:
        g, r = report["gptq"], report["rtn"]
        report["gptq_beats_rtn"] = {"ppl": g["ppl"] < r["ppl"], "mean_kl": g["mean_kl"] < r["mean_kl"],
                                    "top1_agreement": g["top1_agreement"] > r["top1_agreement"], "L": g["L"] >= r["L"]}
    return report


def flat_metrics(report: dict[str, Any]) -> dict[str, float]:
    """The report's numbers as flat MLflow metric names (quantize.gptq.ppl, quantize.speed.T1.int4_over_target...)."""
    out: dict[str, float] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}")
        elif isinstance(node, (int, float)) and not isinstance(node, bool) and math.isfinite(node):
            out[prefix] = float(node)

    for key in ("ppl_target", "gptq", "rtn", "speed"):
        if key in report:
            walk(report[key], f"quantize.{key}")
    return out

