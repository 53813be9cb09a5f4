"""Acceptance L_i: greedy generation with :class:`~polyspec.decode.chain.ChainDecoder` on calibration prompts for
one configuration (levels, draft_k, mu, tree), every level wrapped in a :class:`RecordingLevel` that records the width
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
from dataclasses import asdict, dataclass, field
from typing import Any

from polyspec.errors import PolyspecError
from polyspec.export.results import LevelRun, Run
from polyspec.export.timing import sync


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


def mode_of(n_levels: int) -> str:
    return {1: "ar", 2: "dual"}.get(n_levels, "chain")


def _seq_len(prompts: list[list[int]], max_new_tokens: int, draft_k: int, mu: list[int], lookup: int = 0) -> int:
    return max(len(p) for p in prompts) + max_new_tokens + max(draft_k, max(mu or [0]), lookup) + 8


class ConfigRun:
    """One configuration (levels top first, draft_k, mu, tree): its decoder, every level wrapped in a
    :class:`RecordingLevel`, and the counts summed over the prompts :meth:`step` has generated so far. Several
    configurations over the same loaded levels can take turns prompt by prompt (:func:`run_interleaved`): each
    generation resets the caches it uses, and every decoder must then be built for the same ``max_seq_len``."""

    def __init__(self, levels: list[Any], max_new_tokens: int, *, draft_k: int, max_seq_len: int,
                 mu: list[int] | None = None, eos_ids: set[int] | frozenset[int] = frozenset(), label: str = "",
                 tree: Any = None, draft_lookup: int = 0):
        from polyspec.decode.chain import ChainDecoder

        self.levels, self.max_new_tokens, self.eos_ids, self.label, self.tree = levels, max_new_tokens, eos_ids, label, tree
        self.wrapped = [RecordingLevel(lv) for lv in levels]
        mu = list(mu or []) if len(levels) > 2 else []
        self.dec = ChainDecoder(self.wrapped, draft_k=draft_k, mu=mu, tree=tree if len(levels) > 1 else None,
                                max_seq_len=max_seq_len, draft_lookup=draft_lookup)
        self.draft_lookup = self.dec.draft_lookup  # 0 where it does not apply (ar, a tree)
        self.draft_k = draft_k
        self.tallies = [_Tally() for _ in self.wrapped]
        self.outputs: list[list[int]] = []
        self.seconds = 0.0
        self.pairs = [[0, 0] for _ in self.wrapped[1:]]  # per adjacent pair: [forwards below, verifications above]

    def step(self, ids: list[int]) -> None:
        """Generate greedily after one prompt and add its counts."""
        from polyspec.decode.chain import SamplingParams

        for w in self.wrapped:
            w.calls.clear()
        res = self.dec.generate(list(ids), self.max_new_tokens, SamplingParams(), seed=0, eos_token_ids=self.eos_ids)
        self.outputs.append(list(res.token_ids))
        self.seconds += float(res.stats["seconds"])
        for w, st, tally in zip(self.wrapped, res.level_stats, self.tallies, strict=True):
            tally.add(st, w.calls)
        for i, pair in enumerate(self.pairs):
            pair[0] += res.level_stats[i + 1].forward_passes
            pair[1] += len(res.level_stats[i].accept_lengths)

    def result(self) -> Run:
        """The aggregated measurements over the prompts stepped so far."""
        n, seconds, tree = sum(len(o) for o in self.outputs), self.seconds, self.tree
        last = len(self.wrapped) - 1
        per_level = {w.name: t.level_run(i < last or last == 0, n)
                     for i, (w, t) in enumerate(zip(self.wrapped, self.tallies, strict=True))}
        prefill = sum(t.prefill_seconds for t in self.tallies)
        spec = len(self.levels) > 1
        return Run(label=self.label or mode_of(len(self.levels)), mode=mode_of(len(self.levels)),
                   levels=[w.name for w in self.wrapped],
                   draft_k=(tree.depth if tree is not None else self.draft_k) if spec else None, mu=list(self.dec.mu),
                   tree=asdict(tree) if tree is not None and spec else None, prompts=len(self.outputs),
                   max_new_tokens=self.max_new_tokens, new_tokens=n, seconds=seconds,
                   tokens_per_second=n / seconds if seconds > 0 else 0.0,
                   forward_seconds=sum(t.forward_seconds for t in self.tallies), prefill_seconds=prefill,
                   tokens_per_second_steady=n / (seconds - prefill) if seconds > prefill else 0.0,
                   betas=[a / b if b else None for a, b in self.pairs], per_level=per_level, outputs=self.outputs,
                   draft_lookup=self.draft_lookup)


def run_config(levels: list[Any], prompts: list[list[int]], max_new_tokens: int, *, draft_k: int,
               mu: list[int] | None = None, eos_ids: set[int] | frozenset[int] = frozenset(),
               label: str = "", tree: Any = None) -> Run:
    """Greedy generation over ``prompts`` with a chain of ``levels`` (top first); aggregated measurements.

    ``mu``: one block size per verifier below the target (len(levels) - 2 entries; ignored for ar and dual).
    ``tree``: a :class:`~polyspec.decode.chain.TreeParams` for an EAGLE-2 draft tree (then ``draft_k`` is unused and
    reported as the tree's depth).
    """
    return run_interleaved([dict(levels=levels, draft_k=draft_k, mu=mu, label=label, tree=tree)], prompts,
                           max_new_tokens, eos_ids=eos_ids)[0]


def run_interleaved(configs: list[dict[str, Any]], prompts: list[list[int]], max_new_tokens: int, *,
                    eos_ids: set[int] | frozenset[int] = frozenset()) -> list[Run]:
    """Several configurations (each a dict of :class:`ConfigRun`'s keyword arguments: levels, draft_k, and optionally
    mu, label, tree) over the same prompts, taking turns prompt by prompt, so a machine that slows down for a while
    slows them all alike; one Run each, in order."""
    if not prompts:
        raise PolyspecError("run_config needs at least one calibration prompt")
    size = max(_seq_len(prompts, max_new_tokens, c["draft_k"], list(c.get("mu") or []), c.get("draft_lookup", 0))
               for c in configs)
    runs = [ConfigRun(max_new_tokens=max_new_tokens, max_seq_len=size, eos_ids=eos_ids, **c) for c in configs]
    for ids in prompts:
        for r in runs:
            r.step(ids)
    return [r.result() for r in runs]


def steady_widths(run: Run, name: str) -> dict[int, int]:
    """Forward widths of one level in a run (prefill forwards excluded): {width: count}."""
    return {int(k): int(v) for k, v in run.per_level[name].widths.items() if int(v) > 0}
