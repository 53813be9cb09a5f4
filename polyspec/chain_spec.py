"""The chain's own schema: its levels, and how to decode with them (mode, what drafts, mu, sampling defaults).

A chain folder's ``manifest.json`` is a :class:`ChainManifest`; the engine (``polyspec.decode``) reads these types
and nothing of the recipe. The recipe's ``decode`` section *is* a :class:`DecodeSpec` (the configuration the profile
starts from, and its draft-tree candidate): the recipe imports this module, never the reverse. Light: pydantic only,
no torch.

What a round drafts is one :class:`DraftSpec` everywhere: the recipe, the manifest, ``generate``, ``serve`` and
``bench`` (its compact text form, ``k=1,lookup=6,tree=2x1x2``, is what their flags and bench mode names take).
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polyspec import __version__
from polyspec.errors import PolyspecError
from polyspec.modes import CHAIN, MODES

SCHEMA_VERSION = 2

# A draft head's kind: its folder's config.json ``head_type`` and the recipe's ``train.head`` (decode/head.py,
# decode/head3.py). eagle3.1 is EAGLE-3 with Eagle 3.1's two norms (fc_norm on each fused layer, the final norm's
# output fed back: norm_output), as vllm-project/speculators and SpecForge name them.
HeadType = Literal["eagle", "eagle3", "eagle3.1"]
HEAD_TYPES: tuple[str, ...] = get_args(HeadType)
EAGLE3_TYPES = ("eagle3", "eagle3.1")  # the EAGLE-3 family: fused aux layers, their own lm_head


class Spec(BaseModel):
    """Unknown keys are errors; values are checked on assignment too; no NaN or infinity anywhere."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TreeShape(Spec):
    """An EAGLE-2 dynamic draft tree drawn by the head (docs/DECODE.md, "Draft trees")."""

    top_k: int = Field(8, ge=1, description="children per expanded node, and nodes expanded per depth")
    depth: int = Field(5, ge=1, description="draft forwards per tree (the longest path)")
    total_tokens: int = Field(32, ge=1, description="most draft tokens in one tree (the root not counted)")

    def text(self) -> str:
        return f"{self.top_k}x{self.depth}x{self.total_tokens}"


class DraftSpec(Spec):
    """What proposes the tokens a round verifies (docs/DECODE.md, "What drafts").

    source model: the chain's bottom level (an EAGLE head, or a small model) drafts ``k`` tokens per round, or a ``tree``. With
    ``lookup`` > 0, where the context's last 2+ tokens occurred before, prompt lookup's continuation of them (up to
    ``lookup`` tokens, RUN_PER_MATCH per matched token) is the round's block instead of the head's; a linear block
    the head began is finished by lookup once the text ends in such a repeat. source lookup: prompt lookup alone
    drafts (no model), up to ``lookup`` tokens where it has a continuation, else the round is a plain decoding step.
    Exact at T = 0 and T > 0: which source proposes depends only on the context."""

    source: Literal["model", "lookup"] = Field("model", description="model: the chain's bottom level (its draft "
                                               "head) drafts; lookup: prompt lookup alone (no model)")
    k: int = Field(4, ge=1, description="tokens the draft model drafts per linear round")
    tree: TreeShape | None = Field(None, description="the draft drafts an EAGLE-2 tree of this shape instead of k "
                                   "tokens (null: linear drafts). In a recipe: a candidate the profile weighs")
    lookup: int = Field(0, ge=0, description="prompt lookup: up to this many tokens per round where the context's "
                        "last 2+ tokens occurred before (0: off)")
    vocab: int = Field(0, ge=0, description="the head's logits over its this-many most frequent training tokens "
                       "(0: the full vocabulary)")

    @model_validator(mode="after")
    def _consistent(self) -> DraftSpec:
        if self.source == "lookup" and not self.lookup:
            raise ValueError("source lookup needs lookup >= 1 (the most tokens prompt lookup proposes per round)")
        if self.source == "lookup" and self.tree is not None:
            raise ValueError("a draft tree is a model's: source lookup drafts linear runs (set tree to null)")
        return self

    def text(self, vocab: bool = True) -> str:
        """The compact form :meth:`parse` reads (and labels print, ``vocab`` False leaving the vocabulary out):
        ``k=4,lookup=6``, ``tree=2x1x2,lookup=6``, ``source=lookup,lookup=8``."""
        if self.source == "lookup":
            parts = ["source=lookup", f"lookup={self.lookup}"]
        else:
            parts = [f"tree={self.tree.text()}" if self.tree is not None else f"k={self.k}"]
            parts += [f"lookup={self.lookup}"] if self.lookup else []
        return ",".join(parts + ([f"vocab={self.vocab}"] if vocab and self.vocab else []))

    @property
    def depth(self) -> int:
        """Draft forwards per round at most: k, a tree's depth (0 for prompt lookup alone)."""
        return 0 if self.source == "lookup" else (self.tree.depth if self.tree is not None else self.k)

    @classmethod
    def parse(cls, text: str, base: DraftSpec | None = None) -> DraftSpec:
        """``key=value`` pairs (keys source, k, tree, lookup, vocab; tree as TOPKxDEPTHxTOTAL or ``none``) over
        ``base`` (default: the defaults); one PolyspecError naming what is wrong."""
        update: dict[str, Any] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in cls.model_fields:
                raise PolyspecError(f"draft setting {part!r}: write key=value with key one of "
                                    f"{', '.join(cls.model_fields)} (e.g. k=1,lookup=6 or tree=2x1x2)", exit_code=2)
            update[key] = _tree_value(value) if key == "tree" else value
        data = (base or cls()).model_dump() | update
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise PolyspecError(f"draft settings {text!r}: {_first_error(exc)}", exit_code=2) from None


def _tree_value(value: str) -> dict[str, int] | None:
    if value.lower() in ("none", "null", "off", ""):
        return None
    parts = value.lower().split("x")
    if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise PolyspecError(f"tree={value!r}: write TOPKxDEPTHxTOTAL, e.g. tree=8x5x32, or tree=none", exit_code=2)
    return dict(zip(("top_k", "depth", "total_tokens"), map(int, parts), strict=True))


def _first_error(exc: ValidationError) -> str:
    e = exc.errors()[0]
    key = ".".join(str(p) for p in e["loc"])
    return f"{key + ': ' if key else ''}{e['msg'].removeprefix('Value error, ')}"


class DecodeSpec(Spec):
    """How a chain decodes: the mode, what drafts, the verifiers' block sizes and the sampling defaults."""

    mode: Literal[MODES] = Field(CHAIN, description="ar: the target alone; dual: the target over the draft; chain: "
                                 "every level")
    draft: DraftSpec = Field(default_factory=DraftSpec)
    mu: list[int] = Field(default_factory=lambda: [8], description="per verifier below the target, top first: a "
                          "level verifies once the level below holds >= mu tokens")
    temperature: float = Field(0.0, ge=0, description="0 = greedy")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    max_new_tokens: int = Field(128, ge=1, description="default answer length")

    @field_validator("mu")
    @classmethod
    def _mu_positive(cls, v: list[int]) -> list[int]:
        if not v or any(m < 1 for m in v):
            raise ValueError("must be a non-empty list of integers >= 1")
        return v


class LevelEntry(Spec):
    """One level of a chain."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    kind: Literal["target", "int4", "model", "head"]
    path: str = Field(description="folder relative to the chain folder")
    files: dict[str, str] = Field(description="file (relative to the level folder) -> sha256")
    dtype: str = "float32"
    base_model: str | None = Field(None, description="identity of the model this level was made from")
    quantization: dict[str, Any] | None = Field(None, description="bits, group_size, sym, method, padding ...")
    reads_features_from: str | None = Field(None, description="heads: the level whose hidden states it reads")


class EngineEntry(Spec):
    """The draft head in a serving engine's own folder layout (``engines/<name>/``, written by the export)."""

    format: str = Field(description="the head format (export/head_formats.py FORMATS) the folder is written in")
    path: str = Field(pattern=r"^engines/[A-Za-z0-9_.-]+$", description="folder relative to the chain folder")
    files: dict[str, str] = Field(description="file (relative to the engine folder) -> sha256")


class ChainManifest(Spec):
    """A self-describing chain (``manifest.json``)."""

    schema_version: int = SCHEMA_VERSION
    polyspec_version: str = __version__
    created_at: str = Field(default_factory=lambda: datetime.now(timezone.utc).isoformat(timespec="seconds"))
    levels: list[LevelEntry]
    decode: DecodeSpec = Field(default_factory=DecodeSpec)
    measurements: dict[str, Any] = Field(default_factory=dict)
    stamps: dict[str, Any] = Field(default_factory=dict)
    engines: dict[str, EngineEntry] = Field(default_factory=dict, description="engine name (vllm, sglang, eagle) -> "
                                            "the draft head in that engine's format")

    @model_validator(mode="before")
    @classmethod
    def _upgrade(cls, data: Any) -> Any:
        """A schema 1 manifest (polyspec before the DraftSpec) read as schema 2: its decode section translated."""
        if isinstance(data, dict) and data.get("schema_version") == 1:
            data = {**data, "schema_version": SCHEMA_VERSION}
            if isinstance(data.get("decode"), dict):
                data["decode"] = decode_from_v1(data["decode"])
        return data

    def level(self, name: str) -> LevelEntry:
        for lv in self.levels:
            if lv.name == name:
                return lv
        raise PolyspecError(f"the chain has no level named {name!r}; it has {[lv.name for lv in self.levels]}")


def decode_from_v1(old: dict[str, Any]) -> dict[str, Any]:
    """A schema 1 ``decode`` section (draft_k, draft_lookup, draft_stop, draft_vocab, ngram, tree.enabled/lookup/
    lookup_first) as a :class:`DecodeSpec` dict. Prompt lookup becomes ``draft.lookup`` (a tree's lookup grafted onto
    the tree is verified alone instead, as lookup_first did); draft_stop (a confidence cut) is gone."""
    tree = old.get("tree") if isinstance(old.get("tree"), dict) else {}
    on = bool(tree.get("enabled"))
    draft: dict[str, Any] = {"k": old.get("draft_k", 4), "vocab": old.get("draft_vocab", 0),
                             "lookup": int((tree.get("lookup") if on else old.get("draft_lookup")) or 0)}
    if on:
        draft["tree"] = {k: tree[k] for k in ("top_k", "depth", "total_tokens") if k in tree}
    if old.get("ngram"):
        draft.update(source="lookup", lookup=max(draft["lookup"], int(old.get("draft_k", 4))), tree=None)
    keep = ("mode", "mu", "temperature", "top_p", "top_k", "max_new_tokens")
    return {k: old[k] for k in keep if k in old} | {"draft": draft}



def add_draft_flags(p: Any) -> None:
    """The draft flags generate and bench take (argparse), from this module's schema: ``--draft SPEC`` (a
    :class:`DraftSpec` text over the chain's own draft) and ``--mu``."""
    keys = "; ".join(f"{k}: {f.description}" for k, f in DraftSpec.model_fields.items())
    p.add_argument("--draft", default=None, metavar="SPEC",
                   help=f"what drafts, over the manifest's decode.draft: comma-separated key=value ({keys}); e.g. "
                        "k=1,lookup=6 or tree=8x5x32 or source=lookup,lookup=8")
    p.add_argument("--mu", type=int, nargs="+", default=None,
                   help="block size per verifier below the target (default: the manifest's decode.mu)")


def check_draft_flags(args: Any) -> None:
    """One clear error for a bad --draft or --mu (before any weights load)."""
    if getattr(args, "draft", None):
        DraftSpec.parse(args.draft)
    if getattr(args, "mu", None) is not None and any(m < 1 for m in args.mu):
        raise PolyspecError(f"--mu entries must be >= 1, got {args.mu}", exit_code=2)
