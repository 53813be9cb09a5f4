"""``polyspec bench``: AR, dual EAGLE, the polybasic chain and transformers side by side, on the same prompts.

    polyspec bench CHAIN --prompts FILE|builtin [--modes ar default dual:k=1,lookup=6 hf] [--max-new-tokens N]
                   [--temperature T] [--repeats R] [--limit N] [--categories C ...] [--json OUT] [--plot OUT.png]
                   [--forward-times]

How it measures (so that ratios are fair even on a busy machine):

- every model is loaded once; modes run interleaved in one process: for each turn of each question every mode
  generates in turn, the order rotated from one turn to the next, so no mode systematically gets a warmer machine;
- a warm-up generation per mode (untimed) runs before anything is timed (int4 weight packing, allocator, HF caches);
- each generation is timed around the decode call alone (prompt tokenised beforehand);
- multi-turn questions are answered turn by turn through the chat template with the previous answer in the history;
  every mode gets the same history (the reference mode's answer: ``ar`` when it runs), so all modes decode the same
  prompts;
- tokens/s of a set of generations = total new tokens / total seconds; speedup = that over ``ar``'s on the same set;
  mean accepted per level = tokens a level emitted / its forward passes (the target's value is the paper's mu);
- at temperature 0 every mode's tokens are compared with ``ar``'s and each difference is listed (``hf`` runs another
  implementation in float32, so rare float-noise differences there are reported, not hidden).

``hf`` is transformers' ``AutoModelForCausalLM.generate`` on the chain's target folder; ``hf-assisted`` is
transformers' assisted generation with the chain's first intermediate level as the assistant, when transformers can
load and run it; otherwise the report carries a "not applicable" entry with the reason.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from polyspec.chain_spec import DraftSpec, add_draft_flags, check_draft_flags
from polyspec.errors import PolyspecError
from polyspec.modes import MODES as DECODE_MODES

# default: what the chain's manifest chose (its mode, what drafts, mu); ar / dual / chain draft as --draft says over
# the manifest's draft, and MODE:SPEC (e.g. dual:tree=2x1x2,lookup=6) as SPEC says over it
DEFAULT = "default"
ENGINE_MODES = (*DECODE_MODES, DEFAULT)
MODES = (*ENGINE_MODES, "hf", "hf-assisted")


# ---------------------------------------------------------------------------------------------------------------------
# Runners: one per mode, all with generate(prompt_ids, ...) -> Generation


@dataclass
class Generation:
    """One timed generation: the new tokens, seconds around the decode call, per-level counters (engine modes)."""

    token_ids: list[int]
    seconds: float
    levels: list[dict[str, Any]] = field(default_factory=list)  # [{name, forward_passes, tokens_emitted}]
    accept_lengths: dict[str, list[int]] = field(default_factory=dict)  # verifier level -> tokens per verification


class NotApplicable(Exception):
    """A mode that cannot run on this chain / machine; the message says why (it goes into the report)."""


class EngineRunner:
    """ar / dual / chain through polyspec's ChainDecoder; the loaded models are shared by all engine modes."""

    def __init__(self, chain: Any, mode: str, *, draft: DraftSpec | None = None, mu: list[int] | None = None):
        """mode: ar, dual, chain (drafting as ``draft``, None: the manifest's) or default (the manifest's choice
        whole: its mode, draft and mu)."""
        base = chain.mode if mode == DEFAULT else mode
        self.draft, self.mu = (None, None) if mode == DEFAULT else (draft, mu)
        try:
            chain.levels_for(base, self.draft)
        except PolyspecError as exc:
            raise NotApplicable(str(exc)) from None
        self.chain, self.mode = chain, base

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Any, seed: int,
                 eos: set[int]) -> Generation:
        from polyspec.decode.generate import build_decoder, cache_size
        from polyspec.decode.timing import timed

        size = cache_size(self.chain, len(prompt_ids), max_new_tokens)
        dec = build_decoder(self.chain, self.mode, max_seq_len=size, draft=self.draft, mu=self.mu)
        device = next(self.chain.models[self.chain.order[0]].parameters()).device
        res, seconds = timed(lambda: dec.generate(prompt_ids, max_new_tokens, sampling, seed=seed, eos_token_ids=eos),
                             device)
        levels = [{"name": s.name, "forward_passes": s.forward_passes, "tokens_emitted": s.tokens_emitted}
                  for s in res.level_stats]
        accept = {s.name: list(s.accept_lengths) for s in res.level_stats if s.accept_lengths and self.mode != "ar"}
        return Generation(list(res.token_ids), seconds, levels, accept)


class HFRunner:
    """transformers ``generate`` on the target folder (optionally with an assistant model: assisted generation)."""

    def __init__(self, model: Any, assistant: Any = None):
        self.model, self.assistant = model, assistant

    @staticmethod
    def load(folder: Path, device: str, dtype: Any) -> Any:
        from transformers import AutoModelForCausalLM, GenerationConfig

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, use_safetensors=True).to(device).eval()
        model.generation_config = GenerationConfig()  # no sampling defaults from the folder: only what we pass
        return model

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: Any, seed: int,
                 eos: set[int]) -> Generation:
        import torch
        from transformers import GenerationConfig

        from polyspec.decode.timing import timed

        device = next(self.model.parameters()).device
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T]
        eos_list = sorted(eos) or None
        kw: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": eos_list,
                              "pad_token_id": eos_list[0] if eos_list else 0}
        if sampling.temperature > 0:
            kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        else:
            kw.update(do_sample=False)
        config = GenerationConfig(**kw)
        extra = {"assistant_model": self.assistant} if self.assistant is not None else {}
        torch.manual_seed(seed)
        with torch.inference_mode():
            out, seconds = timed(lambda: self.model.generate(ids, attention_mask=torch.ones_like(ids),
                                                             generation_config=config, **extra), ids.device)
        new = [int(t) for t in out[0, len(prompt_ids):].tolist()]
        for j, t in enumerate(new):  # keep up to and including the first EOS (as the engine does)
            if t in eos:
                new = new[:j + 1]
                break
        return Generation(new, seconds)


def _assistant_folder(chain_dir: Path) -> Path:
    from polyspec.manifest import level_folders, read_manifest

    manifest = read_manifest(chain_dir)
    middle = [f for lv, f in zip(manifest.levels, level_folders(chain_dir, manifest), strict=True)
              if lv.kind in ("int4", "model")]
    if not middle:
        raise NotApplicable("the chain has no intermediate model level to use as the assistant (its draft is an "
                            "EAGLE head, which transformers cannot run)")
    return middle[0]


def load_hf_assistant(chain_dir: Path, device: str, tokenizer: Any) -> Any:
    """The chain's first intermediate loaded with transformers and smoke-tested on two tokens, or NotApplicable."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = _assistant_folder(chain_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, device_map=device, use_safetensors=True).eval()
        ids = tokenizer("hello", return_tensors="pt")["input_ids"].to(device)
        with torch.inference_mode():
            model.generate(ids, max_new_tokens=2, do_sample=False)
    except Exception as exc:  # any failure of a third-party loader/kernel means "cannot run here", with its reason
        msg = " ".join(str(exc).split())[:300]
        raise NotApplicable(f"transformers cannot run the intermediate {folder.name} as an assistant here: "
                            f"{type(exc).__name__}: {msg}") from None
    return model


# ---------------------------------------------------------------------------------------------------------------------
# Aggregation


def _rate(tokens: int, seconds: float) -> float | None:
    return tokens / seconds if seconds > 0 else None


def summarize(records: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    """records (one per generation: mode, new_tokens, seconds, levels) -> {mode: {tokens_per_second, speedup_vs_ar,
    mean_accepted {level: emitted / forwards}, new_tokens, seconds, generations}}."""
    out: dict[str, dict[str, Any]] = {}
    for mode in modes:
        rs = [r for r in records if r["mode"] == mode]
        tokens = sum(r["new_tokens"] for r in rs)
        seconds = sum(r["seconds"] for r in rs)
        passes: dict[str, int] = {}
        emitted: dict[str, int] = {}
        for r in rs:
            for lv in r.get("levels") or []:
                passes[lv["name"]] = passes.get(lv["name"], 0) + lv["forward_passes"]
                emitted[lv["name"]] = emitted.get(lv["name"], 0) + lv["tokens_emitted"]
        out[mode] = {
            "tokens_per_second": _rate(tokens, seconds),
            "speedup_vs_ar": None,
            "mean_accepted": {n: emitted[n] / passes[n] for n in passes if passes[n]},
            "new_tokens": tokens,
            "seconds": seconds,
            "generations": len(rs),
        }
    ar = out.get("ar", {}).get("tokens_per_second")
    for stats in out.values():
        if ar and stats["tokens_per_second"] is not None:
            stats["speedup_vs_ar"] = stats["tokens_per_second"] / ar
    return out


def find_mismatches(records: list[dict[str, Any]], reference: str = "ar") -> list[dict[str, Any]]:
    """Each generation whose tokens differ from the reference mode's on the same turn and repeat: where they first
    differ and both lengths."""
    ref = {(r["question_id"], r["turn"], r["repeat"]): r["token_ids"] for r in records if r["mode"] == reference}
    out = []
    for r in records:
        if r["mode"] == reference:
            continue
        want = ref.get((r["question_id"], r["turn"], r["repeat"]))
        if want is None or r["token_ids"] == want:
            continue
        got = r["token_ids"]
        first = next((j for j, (a, b) in enumerate(zip(want, got, strict=False)) if a != b), min(len(want), len(got)))
        out.append({"mode": r["mode"], "question_id": r["question_id"], "category": r["category"], "turn": r["turn"],
                    "repeat": r["repeat"], "first_difference_at": first, "reference_tokens": len(want),
                    "mode_tokens": len(r["token_ids"])})
    return out


def accept_histograms(records: list[dict[str, Any]]) -> dict[str, dict[str, dict[int, int]]]:
    """{mode: {level: {tokens emitted per verification: count}}} over all generations."""
    out: dict[str, dict[str, dict[int, int]]] = {}
    for r in records:
        for level, lengths in (r.get("accept_lengths") or {}).items():
            hist = out.setdefault(r["mode"], {}).setdefault(level, {})
            for n in lengths:
                hist[n] = hist.get(n, 0) + 1
    return {m: {lv: dict(sorted(h.items())) for lv, h in d.items()} for m, d in out.items()}


# ---------------------------------------------------------------------------------------------------------------------
# The benchmark


@dataclass
class BenchSettings:
    modes: list[str]
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    repeats: int = 1
    seed: int = 0
    warmup: int = 1
    draft: str | None = None  # --draft: DraftSpec text over the manifest's draft, for the ar / dual / chain modes
    mu: list[int] | None = None
    device: str = "auto"
    dtype: str | None = None
    chat: bool = True


def parse_modes(items: list[str] | str) -> list[str]:
    """--modes: names (space or comma separated) from MODES, and MODE:SPEC items (a DraftSpec text after an engine
    mode, e.g. ``dual:tree=2x1x2,lookup=6``: its commas belong to the spec)."""
    modes: list[str] = []
    for item in [items] if isinstance(items, str) else items:
        modes += [item.strip()] if ":" in item else [m.strip() for m in item.split(",") if m.strip()]
    bad = [m for m in modes if m.split(":")[0] not in MODES or (":" in m and m.split(":")[0] not in DECODE_MODES)]
    if bad or not modes:
        raise PolyspecError(f"--modes: unknown mode(s) {bad}; choose from {', '.join(MODES)}, or ar/dual/chain:SPEC "
                            "with a draft spec (e.g. dual:k=1,lookup=6)")
    for m in modes:
        if ":" in m:
            DraftSpec.parse(m.split(":", 1)[1])  # one clear error before any weights load
    if len(set(modes)) != len(modes):
        raise PolyspecError(f"--modes names a mode twice: {modes}")
    return modes


def engine_draft(mode: str, chain: Any, s: BenchSettings) -> tuple[str, DraftSpec | None]:
    """(engine mode, its draft): MODE:SPEC over the manifest's draft, --draft over it for plain modes."""
    base, _, spec = mode.partition(":")
    text = spec or s.draft
    return base, (DraftSpec.parse(text, chain.decode.draft) if text else None)


def _load_runners(chain_dir: Path, chain: Any, s: BenchSettings, log) -> tuple[dict[str, Any], dict[str, str]]:
    runners: dict[str, Any] = {}
    not_applicable: dict[str, str] = {}
    hf_model = None
    for mode in s.modes:
        try:
            if mode.split(":")[0] in ENGINE_MODES:
                base, draft = engine_draft(mode, chain, s)
                runners[mode] = EngineRunner(chain, base, draft=draft, mu=s.mu)
                continue
            if hf_model is None:
                from polyspec.device import resolve_device, resolve_dtype

                dev = resolve_device(s.device)
                # transformers runs the target in the dtype the engine's levels were loaded in (the manifest's)
                dtype = resolve_dtype(s.dtype, dev) if s.dtype else next(chain.models[chain.order[0]].parameters()).dtype
                t0 = time.perf_counter()
                hf_model = HFRunner.load(_target_folder(chain_dir), str(dev), dtype)
                log(f"loaded the target with transformers in {time.perf_counter() - t0:.1f} s")
            if mode == "hf":
                runners[mode] = HFRunner(hf_model)
            else:
                dev = str(next(hf_model.parameters()).device)
                runners[mode] = HFRunner(hf_model, load_hf_assistant(chain_dir, dev, chain.tokenizer))
        except NotApplicable as exc:
            not_applicable[mode] = str(exc)
            log(f"{mode}: not applicable — {exc}")
    return runners, not_applicable


def _target_folder(chain_dir: Path) -> Path:
    from polyspec.manifest import level_folders, read_manifest

    return level_folders(chain_dir, read_manifest(chain_dir))[0]


def run_benchmark(chain_dir: Path, questions: list[Any], settings: BenchSettings, *, chain: Any = None,
                  log=None) -> dict[str, Any]:
    """Run every question (each turn, each repeat) through every mode, interleaved; return the report dict
    (overall, by_category, mismatches, not_applicable, acceptance histograms, per-generation records)."""
    from polyspec.decode.chain import SamplingParams
    from polyspec.decode.generate import eos_ids, load_chain

    log = log or (lambda msg: print(msg, file=sys.stderr))
    sampling = SamplingParams(settings.temperature, settings.top_p, settings.top_k)
    sampling.check()
    chain_dir = Path(chain_dir)
    t_load = time.perf_counter()
    chain = chain if chain is not None else load_chain(chain_dir, device=settings.device, dtype=settings.dtype)
    runners, not_applicable = _load_runners(chain_dir, chain, settings, log)
    load_seconds = time.perf_counter() - t_load
    order = [m for m in settings.modes if m in runners]
    if not order:
        raise PolyspecError("no requested mode can run: " + "; ".join(f"{m}: {r}" for m, r in not_applicable.items()))
    p = _Pass(runners, order, "ar" if "ar" in order else order[0], chain, settings, sampling, eos_ids(chain.tokenizer))
    _warm_up(p, questions[0], log)
    t_run = time.perf_counter()
    for qi, q in enumerate(questions):
        _run_question(p, q)
        done = sum(r["new_tokens"] for r in p.records if r["mode"] == p.reference)
        log(f"[{qi + 1}/{len(questions)}] {q.category} {q.question_id}: {done} {p.reference} tokens so far, "
            f"{time.perf_counter() - t_run:.0f} s")
    report = _report(p, not_applicable)
    report.update(wall_seconds=time.perf_counter() - t_run, load_seconds=load_seconds)
    return report


@dataclass
class _Pass:
    """One benchmark pass: the runners in their order, the reference mode, the settings, and what it recorded."""

    runners: dict[str, Any]
    order: list[str]
    reference: str
    chain: Any
    settings: BenchSettings
    sampling: Any
    eos: set[int]
    records: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    step: int = 0  # turns run so far: each starts the modes' rotation one further


def _warm_up(p: _Pass, question: Any, log: Any) -> None:
    """Untimed generations of the first question per mode, then (CUDA) every static-step width compiled: the
    warm-up generations reach only some, and the first GPU bench timed the compiler."""
    from polyspec.decode import cuda_graphs
    from polyspec.decode.generate import encode_messages

    s = p.settings
    first = encode_messages(p.chain.tokenizer, [{"role": "user", "content": question.turns[0]}], chat=s.chat)
    for mode in p.order:
        for _ in range(s.warmup):
            p.runners[mode].generate(first, min(8, s.max_new_tokens), p.sampling, s.seed, p.eos)
    cuda_graphs.prewarm(p.chain.models.values(), say=lambda msg: log(f"bench: {msg}"))


def _run_question(p: _Pass, q: Any) -> None:
    """Every turn of ``q`` (each repeat) through every mode, the modes' order rotated per turn; the reference
    mode's answer is the conversation's next assistant turn."""
    from polyspec.decode.generate import encode_messages

    s, tok = p.settings, p.chain.tokenizer
    for rep in range(s.repeats):
        history: list[dict[str, str]] = []
        for turn, text in enumerate(q.turns):
            history.append({"role": "user", "content": text})
            ids = encode_messages(tok, history, chat=s.chat)
            if len(ids) + s.max_new_tokens > p.chain.context:
                p.skipped.append({"question_id": q.question_id, "turn": turn, "prompt_tokens": len(ids),
                                  "reason": f"prompt + max_new_tokens exceed the context ({p.chain.context})"})
                break
            rot = p.step % len(p.order)
            p.step += 1
            answers: dict[str, list[int]] = {}
            for mode in p.order[rot:] + p.order[:rot]:
                g = p.runners[mode].generate(ids, s.max_new_tokens, p.sampling, s.seed + rep, p.eos)
                answers[mode] = g.token_ids
                p.records.append({"mode": mode, "question_id": q.question_id, "category": q.category,
                                  "turn": turn, "repeat": rep, "prompt_tokens": len(ids),
                                  "new_tokens": len(g.token_ids), "seconds": g.seconds, "token_ids": g.token_ids,
                                  "levels": g.levels, "accept_lengths": g.accept_lengths})
            history.append({"role": "assistant", "content": tok.decode(answers[p.reference], skip_special_tokens=True)})


def _report(p: _Pass, not_applicable: dict[str, str]) -> dict[str, Any]:
    """The report of a pass (the caller adds its wall and load seconds)."""
    records, order, reference = p.records, p.order, p.reference
    greedy = p.settings.temperature == 0
    categories = sorted({r["category"] for r in records})
    report: dict[str, Any] = {
        "overall": summarize(records, order),
        "by_category": {c: summarize([r for r in records if r["category"] == c], order) for c in categories},
        "mismatches": find_mismatches(records, reference) if greedy else [],
        "mismatch_check": ("greedy: every mode compared with " + reference) if greedy
        else "not checked (temperature > 0: outputs are samples)",
        "not_applicable": not_applicable,
        "reference_mode": reference,
        "acceptance_histograms": accept_histograms(records),
        "skipped": p.skipped,
        "wall_seconds": 0.0,
        "load_seconds": 0.0,
        "prompts": {c: len({r["question_id"] for r in records if r["category"] == c}) for c in categories},
        "generations": [{k: v for k, v in r.items() if k not in ("token_ids", "accept_lengths")} for r in records],
    }
    for mode, why in not_applicable.items():
        report["overall"][mode] = {"tokens_per_second": None, "speedup_vs_ar": None, "mean_accepted": {},
                                   "not_applicable": why}
    return report


# ---------------------------------------------------------------------------------------------------------------------
# Forward times of each level (the T_i of Lemma 3.1)


def _timed_forward(model: Any, kind: str, prefix: int, ids: Any, feats: Any) -> float:
    """Seconds of one forward of ids [T] after a cache holding ``prefix`` positions (truncated back first)."""
    import torch

    from polyspec.decode.timing import timed

    model.truncate(prefix)
    with torch.inference_mode():
        return timed(lambda: model.forward(ids, feats) if kind == "head" else model.forward(ids), ids.device)[1]


def forward_times(chain: Any, *, widths: list[int], prefix: int = 128, repeats: int = 20,
                  warmup: int = 3, seed: int = 0) -> dict[str, Any]:
    """Median milliseconds of one forward of every level over ``widths`` new tokens (T = 1 is a decode step, T = k + 1
    a verification of k tokens) after a ``prefix``-token cache; levels and widths are interleaved within each repeat.
    Ratios are relative to the target at the same width."""
    import torch

    if prefix < 1 or repeats < 1 or not widths or min(widths) < 1:
        raise PolyspecError("forward_times needs prefix >= 1, repeats >= 1 and widths >= 1")
    gen = torch.Generator().manual_seed(seed)
    top = chain.models[chain.order[0]]
    vocab, hidden = top.args.vocab_size, top.args.hidden_size
    size = prefix + max(widths) + 1
    ids = torch.randint(0, vocab, (size,), generator=gen)  # [size]
    feats = torch.randn(size, hidden, generator=gen)  # [size, H]: the head's feature inputs (values do not matter)
    names = list(chain.order)
    inputs: dict[str, tuple[Any, Any]] = {}  # level -> (ids, features) on its device and dtype
    for n in names:
        m, kind = chain.models[n], chain.kinds[n]
        m.setup_cache(size)
        p = next(m.parameters())
        inputs[n] = (ids.to(p.device), feats.to(device=p.device, dtype=p.dtype))
        with torch.inference_mode():  # fill the cache with the prefix
            x, f = inputs[n]
            (m.forward(x[:prefix], f[:prefix]) if kind == "head" else m.forward(x[:prefix]))
    times: dict[str, dict[int, list[float]]] = {n: {w: [] for w in widths} for n in names}
    for r in range(warmup + repeats):
        for w in widths:
            for n in names:
                x, f = inputs[n]
                dt = _timed_forward(chain.models[n], chain.kinds[n], prefix, x[prefix:prefix + w], f[prefix:prefix + w])
                if r >= warmup:
                    times[n][w].append(dt)
    ms = {n: {w: 1000 * statistics.median(v) for w, v in d.items()} for n, d in times.items()}
    return {
        "prefix": prefix, "widths": list(widths), "repeats": repeats,
        "levels": {n: {"kind": chain.kinds[n], "ms": {str(w): ms[n][w] for w in widths}} for n in names},
        "ratio_to_target": {n: {str(w): ms[n][w] / ms[names[0]][w] for w in widths} for n in names},
        "threads": torch.get_num_threads(),
    }


def default_widths(chain: Any, mu: list[int] | None) -> list[int]:
    """T = 1 (a decode step), k + 1 (verifying the manifest's draft block) and mu[0] + 1 (the target verifying a
    block)."""
    d = chain.decode.draft
    k = max(d.depth, d.lookup, 1)
    m = (mu or list(chain.decode.mu) or [8])[0]
    return sorted({1, k + 1, m + 1})


# ---------------------------------------------------------------------------------------------------------------------
# CLI


def configure_parser(p: argparse.ArgumentParser) -> None:
    """Arguments of ``polyspec bench``."""
    p.add_argument("chain", type=Path, help="chain folder (with manifest.json)")
    p.add_argument("--prompts", help="a Spec-Bench question.jsonl (question_id, category, turns) or 'builtin' "
                   "(MT-bench, HumanEval, Python FAQ, Python-doc summarisation, held-out ShareGPT)")
    p.add_argument("--modes", nargs="+", default=[",".join(MODES)],
                   help=f"from {', '.join(MODES)} (space or comma separated; default: all), and ar/dual/chain:SPEC "
                        "(a draft spec over the manifest's, e.g. dual:tree=2x1x2,lookup=6)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (then outputs are checked vs ar)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=1, help="generations per turn and mode (seed + repeat)")
    p.add_argument("--limit", type=int, default=None, help="at most N questions per category")
    p.add_argument("--categories", nargs="+", default=None, help="only these categories (space or comma separated)")
    p.add_argument("--warmup", type=int, default=1, help="untimed warm-up generations per mode (default 1)")
    add_draft_flags(p)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: the dtype the chain's profile chose, else float32 on CPU)")
    p.add_argument("--recipe", type=Path, default=None,
                   help="recipe whose data section defines the held-out ShareGPT split (default: the split the chain's "
                   "draft head records in its training.json, else the DataConfig defaults)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--json", type=Path, default=None, help="write the full report as JSON here")
    p.add_argument("--plot", type=Path, default=None,
                   help="speedup-by-category PNG here, acceptance-length histograms next to it (*_accept.png)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--forward-times", action="store_true",
                   help="also time one forward of every level at each --widths (default: 1, the manifest's draft "
                        "block + 1 and mu + 1 tokens)")
    p.add_argument("--widths", type=int, nargs="+", default=None, help="--forward-times: the widths (new tokens)")
    p.add_argument("--roofline", action="store_true",
                   help="also measure the device's read bandwidth and report the target's batch-1 memory roofline "
                        "(weight bytes / bandwidth) and the fraction of it ar reaches")
    p.add_argument("--forward-prefix", type=int, default=128, help="cached tokens before the timed forward")
    p.add_argument("--forward-repeats", type=int, default=20)


def _heldout_split(args: argparse.Namespace) -> tuple[Any, str | None]:
    """The data section that defines the held-out ShareGPT prompts: --recipe's, else the chain head's own split."""
    if args.recipe is not None:
        from polyspec.config import load_recipe

        return load_recipe(args.recipe).data, None
    if args.prompts != "builtin":
        return None, None
    from polyspec.bench.prompts import head_data_split

    return head_data_split(args.chain)


def _check_args(args: argparse.Namespace) -> None:
    from polyspec.decode.sampling import check_sampling

    check_sampling(args.temperature, args.top_p, args.top_k)
    for name in ("max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise PolyspecError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise PolyspecError(f"--threads must be >= 1, got {args.threads}")
    if args.warmup < 0:
        raise PolyspecError(f"--warmup must be >= 0, got {args.warmup}")
    if args.widths is not None and min(args.widths) < 1:
        raise PolyspecError(f"--widths must be >= 1, got {args.widths}")
    check_draft_flags(args)
    if args.prompts is None and not args.forward_times:
        raise PolyspecError("give --prompts FILE|builtin (or --forward-times alone for level timings)")


def _questions(args: argparse.Namespace, notes: list[str]) -> list[Any]:
    """The prompts --prompts names (none for --forward-times alone), notes on the held-out split added."""
    from polyspec.bench.prompts import load_prompts

    if args.prompts is None:
        return []
    cats = [c for item in (args.categories or []) for c in item.split(",") if c]
    data_cfg, split_note = _heldout_split(args)
    questions = load_prompts(args.prompts, categories=cats or None, limit=args.limit, data_cfg=data_cfg, notes=notes)
    if split_note and any(q.category == "sharegpt" for q in questions):
        notes.append(split_note)
    for n in notes:
        print(f"note: {n}", file=sys.stderr)
    return questions


def _extras(args: argparse.Namespace, chain: Any, report: dict[str, Any]) -> None:
    """--forward-times and --roofline, added to the report."""
    if args.forward_times:
        report["forward_times"] = forward_times(chain, widths=args.widths or default_widths(chain, args.mu),
                                                prefix=args.forward_prefix, repeats=args.forward_repeats)
    if args.roofline:
        from polyspec.bench.roofline import measure_bandwidth, roofline

        top = chain.models[chain.order[0]]
        bw = measure_bandwidth(next(top.parameters()).device)
        ar = (report.get("overall") or {}).get("ar", {}).get("tokens_per_second")
        report["roofline"] = roofline(top, bw["median_GBps"], ar) | {"bandwidth": bw}


def _run_record(args: argparse.Namespace, chain: Any, settings: BenchSettings, notes: list[str],
                load_before: Any) -> dict[str, Any]:
    """What the report says about how it ran: command, settings, machine, load."""
    import torch

    from polyspec.decode.cpu_kernels import state as cpu_kernel_state
    from polyspec.decode.cuda_graphs import runner_of
    from polyspec.stamp import command_line, hardware_stamp, software_stamp

    return {
        "command": command_line(getattr(args, "command", None)),
        "settings": {**settings.__dict__, "prompts": args.prompts, "limit": args.limit,
                     "categories": args.categories, "chain": str(args.chain), "decode": chain.decode.model_dump(),
                     "levels": list(chain.order), "torch_threads": torch.get_num_threads(),
                     "cpu_kernels": cpu_kernel_state(),
                     "cuda_graphs": {n: runner_of(m) is not None for n, m in chain.models.items()}},
        "notes": notes,
        "load_average": {"before": load_before, "after": os.getloadavg() if hasattr(os, "getloadavg") else None},
        "stamp": {"hardware": hardware_stamp(), "software": software_stamp()},
    }


def run(args: argparse.Namespace) -> int:
    """Benchmark ar, dual, chain, hf and hf-assisted on the same prompts, interleaved; JSON, table and plots."""
    from polyspec.bench.report import print_report, write_json, write_plots
    from polyspec.decode.cpu_kernels import state as cpu_kernel_state
    from polyspec.decode.generate import load_chain

    _check_args(args)
    modes = parse_modes(args.modes)
    notes: list[str] = []
    questions = _questions(args, notes)
    settings = BenchSettings(modes=modes, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                             top_p=args.top_p, top_k=args.top_k, repeats=args.repeats, seed=args.seed,
                             warmup=args.warmup, draft=args.draft, mu=args.mu, device=args.device, dtype=args.dtype,
                             chat=not args.raw)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    chain = load_chain(args.chain, device=args.device, dtype=args.dtype)
    if next(chain.models[chain.order[0]].parameters()).device.type == "cpu":
        print(f"CPU kernels: {cpu_kernel_state()}", file=sys.stderr)
    report = run_benchmark(args.chain, questions, settings, chain=chain) if questions else {}
    _extras(args, chain, report)
    report.update(_run_record(args, chain, settings, notes, load_before))
    print_report(report)
    if args.json is not None:
        write_json(report, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    if args.plot is not None and questions:
        for path in write_plots(report, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0
