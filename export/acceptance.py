"""Acceptance L_i: greedy generation with :class:`~polyspec.decode.chain.ChainDecoder` on calibration prompts for
one configuration (levels, draft, mu), every level wrapped in a :class:`RecordingLevel` that records the width
and wall time of each forward.

Definitions (per level i above the draft, N = tokens the chain output):
  L_i     = mean tokens emitted per verification of level i (accepted + correction/bonus; the paper's L_i)
  L_eff_i = N / verifications of level i (what Lemma 3.1 needs for the time per output token; equals L_i for the
            target, is smaller for an intermediate whose emitted tokens the levels above partly reject)
  beta_i  = forwards of level i+1 per verification of level i; the paper's beta is the last one (draft forwards per
            verification of the level directly above the draft).
A level's first forward in each generation processes the prompt (a prefill): it is timed apart and left out of the
width histogram that steady-state costs are computed from.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from polyspec.decode.timing import sync
from polyspec.errors import PolyspecError
from polyspec.export.results import LevelRun, Run


class RecordingLevel:
    """A chain level that records (width, seconds, prefill) of every forward of the level it wraps."""

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
    def device(self) -> Any:
        import torch

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
        sync(self.device)
        t0 = time.perf_counter()
        out = call()
        sync(self.device)
        self.calls.append((width, time.perf_counter() - t0, self._fresh))
        self._fresh = False
        return out

    def forward(self, tokens: list[int], start_pos: int, features: Any = None, *, last_only: bool = False,
                logit_rows: int | None = None) -> Any:
        return self._timed(len(tokens), lambda: self.inner.forward(tokens, start_pos, features, last_only=last_only,
                                                                    logit_rows=logit_rows))

    def __getattr__(self, name: str) -> Any:
        # The tree methods exist only when the wrapped level has them (ChainDecoder checks with hasattr).
        if name == "forward_tree" and hasattr(self.inner, "forward_tree"):
            return self._forward_tree
        if name == "compact" and hasattr(self.inner, "compact"):
            return self.inner.compact
        raise AttributeError(name)

    def _forward_tree(self, tokens: list[int], positions: list[int], mask: Any, features: Any = None) -> Any:
        return self._timed(len(tokens), lambda: self.inner.forward_tree(tokens, positions, mask, features))


@dataclass
class _Tally:
    """One level's counts summed over the prompts of a run."""

    forward_passes: int = 0
    catch_up_passes: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    tokens_emitted: int = 0
    widths: Counter = field(default_factory=Counter)
    forward_seconds: float = 0.0
    prefill_seconds: float = 0.0

    def add(self, stats: Any, calls: list[tuple[int, float, bool]]) -> None:
        self.forward_passes += stats.forward_passes
        self.catch_up_passes += stats.catch_up_passes
        self.accept_lengths += list(stats.accept_lengths)
        self.tokens_emitted += stats.tokens_emitted
        self.widths.update(width for width, _, pre in calls if not pre)
        self.forward_seconds += sum(s for _, s, _ in calls)
        self.prefill_seconds += sum(s for _, s, pre in calls if pre)

    def level_run(self, verifier: bool, n: int) -> LevelRun:
        lengths = self.accept_lengths
        seen = sum(self.widths.values())
        out = LevelRun(forward_passes=self.forward_passes, catch_up_passes=self.catch_up_passes,
                       widths={k: self.widths[k] for k in sorted(self.widths)},
                       mean_width=sum(k * c for k, c in self.widths.items()) / seen if seen else 0.0,
                       forward_seconds=self.forward_seconds, prefill_seconds=self.prefill_seconds)
        if not verifier:
            out.tokens_proposed = self.tokens_emitted
            return out
        out.verifications = len(lengths)
        out.tokens_emitted = sum(lengths)
        out.L = statistics.fmean(lengths) if lengths else 0.0
        out.L_eff = n / len(lengths) if lengths else 0.0
        out.L_var = statistics.pvariance(lengths) if len(lengths) > 1 else 0.0
        counts = Counter(int(v) for v in lengths)
        out.accept_hist = {k: counts[k] for k in sorted(counts)}
        return out


LOOKUP = "lookup"  # the name a prompt-lookup drafter (no level) has in runs, costs and stats


def _seq_len(prompts: list[list[int]], max_new_tokens: int, draft: Any, mu: list[int]) -> int:
    widest = max(draft.k, draft.lookup, draft.tree.total_tokens if draft.tree else 0) if draft is not None else 0
    return max(len(p) for p in prompts) + max_new_tokens + max(widest, max(mu or [0])) + 8


class ConfigRun:
    """One configuration (levels top first, a DraftSpec or None for ar, mu): its decoder, every level wrapped in a
    :class:`RecordingLevel`, and the counts summed over the prompts :meth:`step` has generated so far. Several
    configurations over the same loaded levels can take turns prompt by prompt (:func:`run_interleaved`): each
    generation resets the caches it uses, and every decoder must then be built for the same ``max_seq_len``."""

    def __init__(self, levels: list[Any], max_new_tokens: int, *, draft: Any, max_seq_len: int,
                 mu: list[int] | None = None, eos_ids: set[int] | frozenset[int] = frozenset(), label: str = ""):
        from polyspec.decode.chain import ChainDecoder

        self.levels, self.max_new_tokens, self.eos_ids, self.label = levels, max_new_tokens, eos_ids, label
        self.wrapped = [RecordingLevel(lv) for lv in levels]
        self.dec = ChainDecoder(self.wrapped, draft=draft, mu=list(mu or [])[:_verifiers(levels, draft) - 1],
                                max_seq_len=max_seq_len)
        self.names = [w.name for w in self.wrapped] + ([LOOKUP] if _levelless(draft) else [])
        self.tallies = [_Tally() for _ in self.names]
        self.outputs: list[list[int]] = []
        self.seconds = 0.0
        self.pairs = [[0, 0] for _ in self.names[1:]]  # per adjacent pair: [forwards below, verifications above]

    def step(self, ids: list[int]) -> None:
        """Generate greedily after one prompt and add its counts."""
        from polyspec.decode.chain import SamplingParams

        for w in self.wrapped:
            w.calls.clear()
        res = self.dec.generate(list(ids), self.max_new_tokens, SamplingParams(), seed=0, eos_token_ids=self.eos_ids)
        self.outputs.append(list(res.token_ids))
        self.seconds += float(res.stats["seconds"])
        calls = [w.calls for w in self.wrapped] + [[]] * (len(self.names) - len(self.wrapped))
        for st, tally, c in zip(res.level_stats, self.tallies, calls, strict=True):
            tally.add(st, c)
        for i, pair in enumerate(self.pairs):
            pair[0] += res.level_stats[i + 1].forward_passes
            pair[1] += len(res.level_stats[i].accept_lengths)

    def result(self) -> Run:
        """The aggregated measurements over the prompts stepped so far."""
        n, seconds, draft = sum(len(o) for o in self.outputs), self.seconds, self.dec.draft
        verifiers = self.dec.verifiers
        per_level = {nm: t.level_run(i < verifiers, n)
                     for i, (nm, t) in enumerate(zip(self.names, self.tallies, strict=True))}
        prefill = sum(t.prefill_seconds for t in self.tallies)
        return Run(label=self.label or self.dec.mode, mode=self.dec.mode, levels=list(self.names),
                   draft=draft.model_dump() if draft is not None else None, mu=list(self.dec.mu),
                   prompts=len(self.outputs), max_new_tokens=self.max_new_tokens, new_tokens=n, seconds=seconds,
                   tokens_per_second=n / seconds if seconds > 0 else 0.0,
                   forward_seconds=sum(t.forward_seconds for t in self.tallies), prefill_seconds=prefill,
                   tokens_per_second_steady=n / (seconds - prefill) if seconds > prefill else 0.0,
                   betas=[a / b if b else None for a, b in self.pairs], per_level=per_level, outputs=self.outputs)


def _levelless(draft: Any) -> bool:
    return draft is not None and draft.source == "lookup"


def _verifiers(levels: list[Any], draft: Any) -> int:
    return len(levels) if draft is None or _levelless(draft) else len(levels) - 1


def run_config(levels: list[Any], prompts: list[list[int]], max_new_tokens: int, *, draft: Any,
               mu: list[int] | None = None, eos_ids: set[int] | frozenset[int] = frozenset(), label: str = "") -> Run:
    """Greedy generation over ``prompts`` with a chain of ``levels`` (top first) drafted as ``draft`` (a
    :class:`polyspec.chain_spec.DraftSpec`; None for ar); aggregated measurements. ``mu``: one block size per
    verifier below the target."""
    return run_interleaved([dict(levels=levels, draft=draft, mu=mu, label=label)], prompts, max_new_tokens,
                           eos_ids=eos_ids)[0]


def run_interleaved(configs: list[dict[str, Any]], prompts: list[list[int]], max_new_tokens: int, *,
                    eos_ids: set[int] | frozenset[int] = frozenset()) -> list[Run]:
    """Several configurations (each a dict of :class:`ConfigRun`'s keyword arguments: levels, draft, and optionally
    mu, label) over the same prompts, taking turns prompt by prompt, so a machine that slows down for a while slows
    them all alike; one Run each, in order."""
    if not prompts:
        raise PolyspecError("run_config needs at least one calibration prompt")
    size = max(_seq_len(prompts, max_new_tokens, c["draft"], list(c.get("mu") or [])) for c in configs)
    runs = [ConfigRun(max_new_tokens=max_new_tokens, max_seq_len=size, eos_ids=eos_ids, **c) for c in configs]
    for ids in prompts:
        for r in runs:
            r.step(ids)
    return [r.result() for r in runs]


def steady_widths(run: Run, name: str) -> dict[int, int]:
    """Forward widths of one level in a run (prefill forwards excluded): {width: count}."""
    return {int(k): int(v) for k, v in run.per_level[name].widths.items() if int(v) > 0}
