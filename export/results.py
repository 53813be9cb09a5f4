"""Typed profile results: a timed forward, a level's share of a run, a run, a grid row, the verdict per insertion, the
decision and the whole profile. Pure dataclasses (no torch); :func:`to_json` / :func:`from_json` convert them to and
from the JSON written as ``profile.json`` (format :data:`PROFILE_FORMAT`, described in docs/PROFILE.md).

Level names are keys throughout (``Run.per_level``, ``Profile.costs``); a chain's levels are ordered target first,
draft last.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any

# 3: typed n-level profile (``levels``, ``insertions``; runs carry ``betas``); 2: three fixed levels, decision falls
# back to ar when ar measured at least as fast.
PROFILE_FORMAT = 4  # 4: runs and decisions carry a DraftSpec


@dataclass
class CostRow:
    """One level's forward with ``width`` new tokens over ``kv_length`` cached positions: timing summary (seconds)."""

    width: int
    kv_length: int
    median_s: float
    p10_s: float
    p90_s: float
    mean_s: float
    min_s: float
    repeats: int


@dataclass
class LevelRun:
    """What one level did over all prompts of one run. Verifiers (every level but the draft, and the lone level of
    ar) carry the acceptance fields; the draft carries ``tokens_proposed``."""

    forward_passes: int
    catch_up_passes: int
    widths: dict[int, int]  # steady forward width -> count (each generation's first forward, the prefill, excluded)
    mean_width: float
    forward_seconds: float
    prefill_seconds: float
    verifications: int | None = None
    tokens_emitted: int | None = None
    L: float | None = None  # mean tokens emitted per verification (the paper's L_i)
    L_eff: float | None = None  # N / verifications: what Lemma 3.1 needs per output token
    L_var: float | None = None
    accept_hist: dict[int, int] | None = None  # tokens per verification -> count
    tokens_proposed: int | None = None


@dataclass
class Prediction:
    """Lemma 3.1 for one run: T/N = sum_{i<n} T_i / L_eff_i + beta T_n / L_eff_{n-1}, with the terms used."""

    time_per_token_s: float
    T: list[float]
    L_eff: list[float]
    beta: float | None


@dataclass
class Run:
    """Greedy generation over the calibration prompts with one chain configuration (levels top first)."""

    label: str
    mode: str  # ar, dual (the target over a drafter), chain (verifiers between)
    levels: list[str]  # top first; a drafter without a level (prompt lookup alone) last, as "lookup"
    draft: dict[str, Any] | None  # the DraftSpec (None: ar)
    mu: list[int]
    prompts: int
    max_new_tokens: int
    new_tokens: int
    seconds: float  # the decoders' own generate time, prefill included, summed over prompts
    tokens_per_second: float
    forward_seconds: float
    prefill_seconds: float
    tokens_per_second_steady: float
    betas: list[float | None]  # betas[i]: forwards of level i+1 per verification of level i
    per_level: dict[str, LevelRun]
    outputs: list[list[int]] = field(default_factory=list)  # token ids per prompt (not persisted)
    predicted: Prediction | None = None

    @property
    def beta(self) -> float | None:
        """Draft forwards per verification of the level directly above the draft (the paper's beta)."""
        return self.betas[-1] if self.betas else None


@dataclass
class GridRow:
    """One grid point: its measured L, beta and T, and the Lemma 3.1 prediction the decision minimises."""

    label: str
    mode: str
    draft: dict[str, Any] | None
    mu: list[int]
    L: dict[str, float]
    L_eff: dict[str, float]
    beta: float | None
    T_s: dict[str, float]
    predicted_time_per_token_s: float
    measured_tokens_per_second: float
    measured_tokens_per_second_steady: float
    new_tokens: int


@dataclass
class InsertionInputs:
    """Theorem 3.2's inputs for inserting M_new between M_i (above) and M_{i+1} (below)."""

    T_i: float
    T_new: float
    T_next: float
    L_i: float  # M_i over M_{i+1} directly (the chain without M_new)
    L_new: float  # M_new over M_{i+1} (M_new heading the levels below it)
    L_i_new: float  # M_i over M_new's blocks (the whole chain)
    beta: float  # forwards of M_{i+1} per verification of M_i, without M_new


@dataclass
class Insertion:
    """The verdict on one inserted level: Theorem 3.2's two sufficient conditions, the exact Lemma 3.1 times of the
    two-level form (``time_before`` / ``time_after`` / ``pays``) and of the whole chains as measured, each at its own
    widths and L_eff (``*_own_widths``)."""

    level: str  # the inserted level
    above: str
    below: str
    label: str
    draft: str | None  # the chain's DraftSpec text (k=4, tree=8x5x32, ...)
    mu: int | None
    inputs: InsertionInputs
    cond1_lhs: float
    cond1_rhs: float
    cond1_holds: bool
    cond2_lhs: float
    cond2_rhs: float
    cond2_holds: bool
    valid_regime: bool
    time_before: float
    time_after: float
    pays: bool
    speedup: float
    before_run: str | None = None  # Profile.final keys of the runs the inputs came from
    tail_run: str | None = None
    time_before_own_widths: float | None = None
    time_after_own_widths: float | None = None
    pays_own_widths: bool | None = None
    beta_chain: float | None = None  # forwards of M_{i+1} per verification of M_new in the whole chain
    L_new_in_chain: float | None = None
    L_new_in_chain_eff: float | None = None
    candidates: list[Insertion] = field(default_factory=list)  # the same insertion at every grid chain point


@dataclass
class VarianceCheck:
    """Measured acceptance-length variance against the exact one of min(G, n) at the alpha fitted to the mean."""

    n: int
    count: int
    approximate: bool = False
    mean: float | None = None
    var_measured: float | None = None
    alpha: float | None = None
    mean_theory: float | None = None
    var_theory: float | None = None
    var_ratio: float | None = None


@dataclass
class SpeedupRow:
    predicted: float
    measured: float
    rel_error: float
    within_goal: bool


@dataclass
class Speedups:
    """Predicted (ratio of Lemma 3.1 times) against measured (ratio of tokens/s) speedups over ``baseline``."""

    baseline: str
    goal_rel_error: float
    configs: dict[str, SpeedupRow]


@dataclass
class Decision:
    """The chain's decode settings: the grid point with the smallest Lemma 3.1 time, or ar (see ``rule``)."""

    mode: str
    speculative_mode: str
    draft: dict[str, Any]  # the chosen DraftSpec (kept for --mode dual / chain where ar is the default)
    mu: list[int]
    predicted_time_per_token_s: float
    grid: dict[str, Any]
    ar_predicted_faster: bool
    ar_measured_faster: bool
    rule: str


@dataclass
class LevelInfo:
    name: str  # key in costs / per_level
    tag: str  # short name in labels (e.g. int4, head)
    folder: str | None = None  # where the level was loaded from


@dataclass
class PromptInfo:
    count: int
    grid_count: int
    max_new_tokens: int
    lengths: list[int]


@dataclass
class Profile:
    """Everything a profile measured and decided (what ``profile.json`` holds)."""

    levels: list[LevelInfo]
    prompts: PromptInfo
    kv_length: int
    warmup: int
    repeats: int
    costs: dict[str, list[CostRow]]
    grid: list[GridRow]
    final: dict[str, Run]
    insertions: list[Insertion]
    decision: Decision
    speedup: dict[str, Speedups]  # wall, steady (both over dual), vs_ar
    variance: dict[str, VarianceCheck]
    lossless_greedy: bool
    format: int = PROFILE_FORMAT
    key: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    torch_threads: int | None = None
    prompt_sources: list[dict[str, Any]] = field(default_factory=list)
    notes: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    stamps: dict[str, Any] = field(default_factory=dict)
    path: str | None = None  # the folder it was read from or written to (not persisted)

    @property
    def names(self) -> list[str]:
        return [lv.name for lv in self.levels]

    @property
    def tags(self) -> dict[str, str]:
        return {lv.name: lv.tag for lv in self.levels}


# ---------------------------------------------------------------------------------------------------------------------
# The chain search (:mod:`polyspec.export.search`; ``search.json``)


@dataclass
class CandidateInfo:
    name: str
    kind: str  # int4 (folder), rtn_int4, model, head, lookup
    bottom_only: bool
    note: str = ""
    group_size: int | None = None  # rtn_int4: the group size export writes its GPTQ folder with


@dataclass
class ChainPoint:
    """One chain the search ran on the grid prompts: its Lemma 3.1 time (None: an L or T it needs was 0)."""

    levels: list[str]
    draft: str
    mu: list[int]
    predicted_time_per_token_s: float | None
    measured_tokens_per_second: float
    L: dict[str, float]
    beta: float | None


@dataclass
class InsertionTried:
    """One insertion the greedy search ran: ``inserted`` at index ``position`` of the new chain (between
    before[position - 1] and before[position]); the whole chains' Lemma 3.1 times before and after (each run at its
    own widths, L_eff and beta) decide; ``verdict`` holds Theorem 3.2's cond1 / cond2 / valid regime and the exact
    two-level times (None where an input was 0)."""

    round: int
    before: list[str]
    inserted: str
    position: int
    draft: str
    mu: int
    time_before_s: float | None
    time_after_s: float | None
    pays: bool
    verdict: Insertion | None = None
    measured_tokens_per_second_before: float | None = None  # the two chains' grid runs, beside the predictions
    measured_tokens_per_second_after: float | None = None


@dataclass
class ConfirmedChain:
    """A chain (or ar) run on all prompts: predicted (Lemma 3.1 on this run and on its grid run) and measured."""

    levels: list[str]
    mode: str
    draft: str | None
    mu: list[int]
    predicted_grid_s: float | None
    predicted_s: float | None
    predicted_tokens_per_second: float | None  # 1 / predicted_s
    tokens_per_second: float
    tokens_per_second_steady: float
    lossless_greedy: bool


@dataclass
class SearchDecision:
    mode: str  # ar, dual or chain
    levels: list[str]
    draft: str | None
    mu: list[int]
    ar_predicted_faster: bool
    ar_measured_faster: bool
    rule: str


@dataclass
class Search:
    """Everything a chain search tried, measured and decided (what ``search.json`` holds)."""

    candidates: list[CandidateInfo]
    settings: dict[str, Any]
    prompts: PromptInfo
    drafts: list[ChainPoint]
    insertions: list[InsertionTried]
    greedy_chain: ChainPoint
    stop_reason: str
    confirmed: list[ConfirmedChain]
    ar: ConfirmedChain
    decision: SearchDecision
    costs: dict[str, list[CostRow]]
    runs: int  # distinct generation runs made
    format: int = 1
    device: str = "cpu"
    dtype: str = "float32"
    notes: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0
    stamps: dict[str, Any] = field(default_factory=dict)
    path: str = ""  # its folder (not persisted)


# ---------------------------------------------------------------------------------------------------------------------
# JSON

_NOT_PERSISTED = {"outputs", "path"}


def to_json(obj: Any) -> Any:
    """A dataclass tree as JSON-ready data (dict keys as strings; ``outputs`` and ``path`` left out)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_json(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.name not in _NOT_PERSISTED}
    if isinstance(obj, dict):
        return {str(k): to_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_json(v) for v in obj]
    return obj


def from_json(cls: type, data: Any) -> Any:
    """The inverse of :func:`to_json` for ``cls`` (a dataclass above): nested dataclasses, lists, dicts with int
    keys and optionals rebuilt from their type hints."""
    return _build(cls, data)


def _build(tp: Any, data: Any) -> Any:
    if data is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        return _build(inner[0], data) if len(inner) == 1 else data
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        names = {f.name for f in dataclasses.fields(tp) if f.init}
        return tp(**{k: _build(hints[k], v) for k, v in data.items() if k in names})
    if origin is list:
        (item,) = typing.get_args(tp)
        return [_build(item, v) for v in data]
    if origin is dict:
        key, value = typing.get_args(tp)
        return {(int(k) if key is int else k): _build(value, v) for k, v in data.items()}
    return data
