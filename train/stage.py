"""``train_stage(recipe.train, TrainInputs(...))``: train the chain's bottom level, an EAGLE-style draft head, and write
its folder.

Steps: refuse impossible runtime settings (DeepSpeed without CUDA, a missing extra) before any work; resolve the
target (and, for ``train.teacher: intermediate``, the int4 model from the quantize stage); compute the key of this
training (target and teacher identity, the data cache key, every result-changing ``train`` setting); return
``<workdir>/head/<key>/`` at once if it is complete; otherwise prepare the data, optionally build the offline
feature cache (after checking ``train.cache_budget_gb``), train with Lightning (resuming from the newest checkpoint
in ``<workdir>/train/<key>/checkpoints/``), evaluate on the held-out split and write the head folder atomically:
``config.json`` + ``model.safetensors`` from :func:`polyspec.decode.head.save_head` (naming its target and the
target's model_id and hash) plus ``training.json`` (settings, steps, timings, held-out metrics).

Multi-process strategies (``ddp`` on CPU or GPUs) use Lightning's subprocess launcher, which starts the other ranks
by re-running the same command: every rank re-enters :func:`train_stage`; only global rank 0 builds caches, logs and
writes the head.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import importlib.util
import itertools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from polyspec.chain_spec import EAGLE3_TYPES
from polyspec.config import EAGLE3_DEFAULTS, EAGLE3_ONLY, EAGLE_DEFAULTS, TTT_KEYS, TrainConfig
from polyspec.device import device_name, fast_bf16_matmul, heap_kept, is_global_rank_zero, resolve_dtype
from polyspec.errors import PolyspecError, missing_extra
from polyspec.fsutil import atomic_file, atomic_folder, damage_note, verify_output, write_file_hashes

TRAIN_FORMAT = 1
TRAINING_JSON = "training.json"
LOG_EVERY = 10  # optimizer steps between MLflow logs of loss components, lr and tokens/s
# train settings that do not change the trained weights (left out of the key)
OPERATIONAL_KEYS = ("checkpoint_every", "cache_budget_gb", "eval_every", "accept_prompts", "compile")
ACCEPT_TOKENS = 48  # new tokens per held-out prompt in the acceptance probe (train.accept_prompts)


def runtime_settings(cfg: TrainConfig, target_device: str) -> dict[str, Any]:
    """Lightning's accelerator / devices / strategy / precision for ``cfg``; PolyspecError for impossible ones.

    DeepSpeed needs CUDA and the ``deepspeed`` package ([deepspeed] extra); precision ``auto`` is bf16-mixed where
    bf16 matrix products are fast (GPUs, CPUs with AVX512-BF16 or AMX: :func:`polyspec.device.fast_bf16_matmul`) and
    32-true elsewhere; ``devices: auto`` is 1 on CPU (2 processes for ddp) and every GPU on CUDA.
    """
    import torch

    cuda = torch.cuda.is_available() and target_device != "cpu"
    if cfg.strategy.startswith("deepspeed"):
        if not torch.cuda.is_available():
            raise PolyspecError(
                f"train.strategy={cfg.strategy} needs CUDA GPUs and none is available here; use train.strategy=auto "
                "(one device) or ddp (several CPU processes or GPUs)", exit_code=2)
        if target_device == "cpu":
            raise PolyspecError(f"train.strategy={cfg.strategy} needs CUDA but target.device is cpu", exit_code=2)
        if importlib.util.find_spec("deepspeed") is None:
            raise missing_extra("deepspeed", "deepspeed")
    if target_device.startswith("cuda") and not torch.cuda.is_available():
        raise PolyspecError(f"target.device={target_device} but CUDA is not available; use target.device=auto or cpu")
    precision = cfg.precision
    if precision == "auto":
        precision = "bf16-mixed" if fast_bf16_matmul("cuda" if cuda else "cpu") else "32-true"
    if precision == "16-mixed" and not cuda:
        raise PolyspecError("train.precision=16-mixed needs a GPU; use 32-true or bf16-mixed on CPU", exit_code=2)
    if cfg.compile and not cuda and not _cpp_compiler():
        raise PolyspecError("train.compile=true on the CPU needs a C++ compiler for torch.compile (inductor) and "
                            "none was found (g++ or clang++, or $CXX); install one or set train.compile=false",
                            exit_code=2)
    devices: int | str = cfg.devices
    if devices == "auto":
        devices = "auto" if cuda else (2 if cfg.strategy == "ddp" else 1)
    elif target_device.startswith("cuda:"):
        devices = [int(target_device[5:])] if devices == 1 else devices
    # strategy names pass through: Lightning picks the gloo backend for ddp on CPU
    return {"accelerator": "gpu" if cuda else "cpu", "devices": devices, "strategy": cfg.strategy,
            "precision": precision, "device": "cuda" if cuda else "cpu"}


def _host_memory(runtime: dict[str, Any]) -> Any:
    """The C heap kept through the CPU's extraction and fit (:func:`polyspec.device.heap_kept`: steps reallocate
    the same large buffers); nothing changes where the tensors live on a GPU."""
    return heap_kept() if runtime["device"] == "cpu" else contextlib.nullcontext()


def _cpp_compiler() -> bool:
    """Whether inductor finds the C++ compiler its CPU code needs (asked before any work, not at the first step)."""
    try:
        from torch._inductor.cpp_builder import get_cpp_compiler

        return bool(get_cpp_compiler())
    except Exception:  # inductor's own search raises when nothing is found
        return False


def train_key(target_id: str, teacher_id: str, data_key: str, cfg: TrainConfig, runtime: dict[str, Any]) -> str:
    """SHA-256 over everything that changes the trained head."""
    cfg = head_settings(cfg)  # an unset option and its default train the same head
    train = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in OPERATIONAL_KEYS}
    if not train.get("ttt_start"):  # keys from before the option existed stay as they were
        train.pop("ttt_start", None)
    # (so do keys from before an EAGLE-1/2 head's train.loss_vocab became its train.draft_vocab)
    train["loss_vocab"] = train.pop("draft_vocab") if cfg.head == "eagle" else 0
    train["weight_decay"] = 0.0  # (and from before weight decay was fixed at EAGLE's 0)
    if cfg.head == "eagle":  # keys of EAGLE-1/2 heads without an unroll are what they were before EAGLE-3 existed
        dropped = ("head", *EAGLE3_ONLY, *(TTT_KEYS if cfg.ttt_steps == 1 else ()))
        for k in dropped:
            train.pop(k, None)
    ident = {"format": TRAIN_FORMAT, "target": target_id, "teacher": teacher_id, "data": data_key, "train": train,
             "runtime": {k: str(runtime[k]) for k in ("strategy", "devices", "precision", "accelerator")}}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def head_is_complete(folder: Path, key: str) -> bool:
    """A head folder written by this stage for exactly this key."""
    try:
        info = json.loads((folder / TRAINING_JSON).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return info.get("key") == key and (folder / "model.safetensors").is_file() and (folder / "config.json").is_file()


def latest_checkpoint(folder: Path) -> Path | None:
    """The checkpoint with the highest step in ``folder`` (files ``step-NNNNNNNN.ckpt``), or None."""
    best: tuple[int, Path] | None = None
    if folder.is_dir():
        for p in folder.glob("step-*.ckpt"):
            m = re.fullmatch(r"step-(\d+)\.ckpt", p.name)
            if m and (best is None or int(m.group(1)) > best[0]):
                best = (int(m.group(1)), p)
    return best[1] if best else None


@dataclass(frozen=True)
class TrainInputs:
    """What the train stage reads besides its section: the target (its recipe section and resolved folder), the
    data section, the draft it trains for (the recipe's decode.draft), the workdir and, for ``train.teacher:
    intermediate``, the int4 folder the head learns from."""

    target: Any  # TargetConfig: source, device, dtype
    target_dir: Path
    data: Any  # DataConfig
    draft: Any  # DraftSpec: k (the unroll and the probe's linear drafts), tree (the probe's tree shape)
    workdir: Path
    teacher_dir: Path | None = None


def _teacher_dir(cfg: TrainConfig, t: TrainInputs) -> tuple[Path, str]:
    """(folder, identity) of the model the head learns from."""
    from polyspec.sources import model_id

    if cfg.teacher == "target":
        return t.target_dir, "target"
    if t.teacher_dir is None:
        raise PolyspecError("train.teacher: intermediate needs the int4 folder (the quantize stage's) as the teacher")
    return Path(t.teacher_dir), "intermediate:" + model_id("local", Path(t.teacher_dir))


def training_summary(head_dir: Path, stage_seconds: float) -> dict[str, Any]:
    """What ``polyspec train`` prints: the head folder and the headline numbers of its training.json."""
    info = json.loads((Path(head_dir) / TRAINING_JSON).read_text(encoding="utf-8"))
    keys = ("steps", "epochs_completed", "fit_seconds", "tokens_per_second", "heldout_top1_agreement",
            "acceptance_length_estimate", "decoder_accept_linear", "decoder_accept_tree", "decoder_accept_depths",
            "train_loss_first",
            "train_loss_last", "resumed_from", "draft_k", "offline_cache")
    return {"head": str(head_dir), "stage_seconds": round(stage_seconds, 1), **{k: info.get(k) for k in keys}}


def _offline_cache(cfg: TrainConfig, workdir: Path, teacher: Any, prepared: Any, *, teacher_id: str, data_key: str,
                   teacher_dtype: Any, extract_device: str, rank0: bool, progress: bool,
                   decoder: Any = None) -> dict[str, Any]:
    """Build (rank 0) or read (other ranks) the teacher's feature cache for ``train.features=offline``; return its
    description for training.json. The teacher keeps only its embedding and lm_head afterwards unless it is also
    the acceptance probe's ``decoder``."""
    import torch

    from polyspec.train.features import build_feature_cache, check_cache_budget

    workdir = Path(workdir)
    aux = tuple(_aux_layers(cfg, teacher))
    tokens = int(prepared.report.get("total_tokens") or sum(len(r) for r in prepared.train["input_ids"]))
    rows = len(prepared.train) + len(prepared.heldout)
    estimate = check_cache_budget(tokens, rows, teacher.args.hidden_size, cfg.cache_budget_gb,
                                  "train.features=offline", aux=len(aux))
    ident = {"teacher": teacher_id, "data": data_key, "dtype": str(teacher_dtype)}
    if aux:  # an EAGLE-3 cache holds other tensors (EAGLE-1/2 keys stay what they were)
        ident["aux_layers"] = list(aux)
    fkey = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:20]
    cache_dir = workdir / "cache" / "features" / fkey
    splits = {"train": prepared.train}
    if len(prepared.heldout):
        splits["heldout"] = prepared.heldout
    t0 = time.perf_counter()
    if rank0:
        teacher.to(extract_device)
        index = build_feature_cache(teacher, splits, cache_dir, batch_size=cfg.batch_size, device=extract_device,
                                    progress=progress, aux_layers=aux, info={"teacher": teacher_id, "data_key": data_key,
                                                             "dtype": "bfloat16",
                                                             "teacher_dtype": str(teacher_dtype)})
        teacher.to("cpu")
    else:  # other ranks start after rank 0 has built it (Lightning launches them at fit time)
        from polyspec.train.features import read_cache_index

        index = read_cache_index(cache_dir)
    cache_info = {"cache_dir": str(cache_dir), "estimate_bytes": estimate, "bytes": index["bytes"],
                  "tokens": index["tokens"], "bytes_per_token": index["bytes_per_token"],
                  "extract_seconds": time.perf_counter() - t0}
    _say(progress and rank0, f"train: feature cache {cache_dir}: {index['bytes'] / 1e6:.1f} MB, "
                             f"{index['bytes_per_token']:.1f} bytes/token (estimate {estimate / 1e6:.1f} MB)")
    if not cfg.accept_prompts or decoder is not teacher:  # only its embedding and lm_head are used now
        teacher.layers = torch.nn.ModuleList()
    return cache_info


def train_stage(cfg: TrainConfig, t: TrainInputs, tracker: Any = None, *, progress: bool = True,
                callbacks: Sequence[Any] = (), log_every: int = LOG_EVERY) -> Path:
    """Train (or find) the draft head the recipe's train section ``cfg`` describes, from ``t`` (the target, data,
    draft and workdir), and return its folder ``<workdir>/head/<key>/``.

    ``tracker``: a :class:`polyspec.tracking.Tracker` to log into (None: no logging). ``progress``: progress bars
    with ETA for feature extraction and training. ``callbacks``: extra Lightning callbacks (tests use one to
    interrupt a run). ``log_every``: optimizer steps between logs of loss components, lr and tokens/s.
    """

    from polyspec.data.prepare import cache_key, prepare_dataset
    from polyspec.sources import load_tokenizer, model_id
    from polyspec.tracking import Tracker

    tracker = tracker if tracker is not None else Tracker()
    rank0 = is_global_rank_zero()
    target_device = device_name(t.target.device)
    runtime = runtime_settings(cfg, target_device)  # refuses DeepSpeed without CUDA before any work

    tokenizer = load_tokenizer(t.target_dir)
    target_id = model_id(t.target.source, t.target_dir)
    teacher_dir, teacher_kind = _teacher_dir(cfg, t)
    teacher_id = target_id if teacher_kind == "target" else teacher_kind
    data_key, _ = cache_key(t.data, tokenizer, target_id)
    key = train_key(target_id, teacher_id, data_key, cfg, runtime)
    out_dir = Path(t.workdir) / "head" / key[:16]
    if _reuse_head(out_dir, key, t, tracker, tokenizer, target_id, say=progress and rank0, rank0=rank0):
        return out_dir

    prepared = prepare_dataset(t.data, tokenizer, workdir=t.workdir, tokenizer_id=target_id,
                               progress=progress and rank0)
    teacher_dtype = _teacher_dtype(runtime["precision"], t.target.dtype)
    extract_device = runtime["device"] if runtime["device"] == "cpu" else "cuda"
    teacher = _load(teacher_dir, teacher_dtype, "cpu")
    # the probe decodes as the chain will: the teacher in the dtype the target is served in
    serve_dtype = resolve_dtype(t.target.dtype, target_device)
    own = serve_dtype != teacher_dtype and rank0 and cfg.accept_prompts
    decoder = _load(teacher_dir, serve_dtype, "cpu") if own else teacher

    cache_info: dict[str, Any] = {}
    if cfg.features == "offline":
        with _host_memory(runtime):
            cache_info = _offline_cache(cfg, t.workdir, teacher, prepared, teacher_id=teacher_id, data_key=data_key,
                                        teacher_dtype=teacher_dtype, extract_device=extract_device, rank0=rank0,
                                        progress=progress, decoder=decoder)
    probe = _acceptance_probe(cfg, t.draft, decoder, prepared, tokenizer) if rank0 else None
    counts = _token_counts(prepared, teacher.args.vocab_size)
    with _host_memory(runtime):
        result = _fit(cfg, t, runtime, teacher, prepared, cache_info, key, tracker, progress, callbacks, log_every,
                      probe, counts)
    head = result.pop("_head")
    if not rank0:
        return out_dir

    ids = {"key": key, "data_key": data_key, "target_id": target_id, "teacher_id": teacher_id}
    _record_head(cfg, t, tracker, out_dir, ids, runtime, cache_info, result, head, counts)
    _say(progress, f"train: head written to {out_dir}")
    return out_dir


def _reuse_head(out_dir: Path, key: str, t: TrainInputs, tracker: Any, tokenizer: Any, target_id: str, *,
                say: bool, rank0: bool) -> bool:
    """Whether a complete, intact head for this key is already at ``out_dir`` (then tagged and returned as is); a
    damaged one is named and trained again."""
    if not head_is_complete(out_dir, key):
        return False
    damage = verify_output(out_dir)
    if damage:
        _say(rank0, f"train: {damage_note(out_dir, damage)}")
        return False
    _say(say, f"train: head for these inputs already exists: {out_dir}")
    tracker.set_tags({"polyspec.train.skipped": "true", "polyspec.train.head": str(out_dir)})
    if rank0:
        _add_token_counts(out_dir, t, tokenizer, target_id)
    return True


def _record_head(cfg: TrainConfig, t: TrainInputs, tracker: Any, out_dir: Path, ids: dict[str, str], runtime: dict[str, Any],
                 cache_info: dict[str, Any], result: dict[str, Any], head: Any, counts: Any) -> None:
    """Write the trained head's folder (weights, target identity, training record) and log it to the tracker."""
    from polyspec.data.prepare import split_record

    target_info = {
        "source": t.target.source,
        "model_id": ids["target_id"],
        "hash": hashlib.sha256(ids["target_id"].encode()).hexdigest()[:16],
        "teacher": cfg.teacher,
        "teacher_model_id": ids["teacher_id"],
    }
    training = {
        "format": TRAIN_FORMAT,
        "key": ids["key"],
        "data_key": ids["data_key"],
        "data_split": split_record(t.data),
        "train": cfg.model_dump(mode="json"),
        "runtime": {k: str(v) for k, v in runtime.items()},
        "draft_k": t.draft.k,
        "offline_cache": cache_info or None,
        **result,
    }
    _write_head(head, out_dir, target_info, training, counts)
    metrics = {k: v for k, v in result.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    tracker.log_metrics({f"train/final_{k}": v for k, v in metrics.items()}, step=int(result["steps"]))
    if cache_info:
        tracker.log_metrics({"offline/bytes_per_token": cache_info["bytes_per_token"],
                             "offline/cache_bytes": cache_info["bytes"]}, step=0)
    tracker.set_tags({"polyspec.train.head": str(out_dir), "polyspec.train.key": ids["key"]})
    tracker.log_artifact(out_dir, "head")


def _teacher_dtype(precision: str, target_dtype: str | None) -> Any:
    """The dtype the teacher computes features in: float32 for 32-true training, bfloat16 for bf16-mixed (the
    features are stored and trained on in bf16 either way, and a bf16 forward ran about 3x faster than a float32 one on
    the 2-core CPU: docs/TRAIN.md), else the target's recipe dtype."""
    import torch

    if precision == "32-true":
        return torch.float32
    if precision == "bf16-mixed":
        return torch.bfloat16
    return getattr(torch, target_dtype if target_dtype not in (None, "auto") else "float16")  # 16-mixed's dtype


def _say(enabled: bool, text: str) -> None:
    if enabled:
        from polyspec.console import say

        say(text)


def _progress_callback(tqdm_bar: type) -> Any:
    """On a terminal, Lightning's training bar there (:func:`_terminal_bar`); on a pipe or a file, polyspec's own
    lines (:class:`polyspec.train.module.LineProgress`) while Lightning's bar, which redraws in place (one endless
    line in a file), goes to the run's log file with the other third-party output."""
    from polyspec.console import stream
    from polyspec.train.module import LineProgress

    return _terminal_bar(tqdm_bar)(refresh_rate=1) if stream().isatty() else LineProgress()


def _terminal_bar(base: type) -> type:
    """Lightning's TQDMProgressBar with the training bar on the terminal (polyspec.console.stream) and its
    validation / sanity-check bars where third-party output goes (the run's log file under polyspec.console.quiet):
    one bar for the stage."""
    from contextlib import redirect_stderr, redirect_stdout

    from polyspec.console import stream

    class TerminalBar(base):
        def init_train_tqdm(self):
            with redirect_stdout(stream()), redirect_stderr(stream()):  # the bar binds its file when it is made
                return super().init_train_tqdm()

    return TerminalBar


def _load(path: Path, dtype, device):
    from polyspec.train.features import load_teacher

    return load_teacher(path, dtype, device)


def _add_token_counts(out_dir: Path, t: TrainInputs, tokenizer: Any, target_id: str) -> None:
    """A complete head written before heads carried token counts gets them from its (cached) prepared data, so
    ``decode.draft.vocab`` works for it too. Written under a temporary name, then renamed."""
    from safetensors.torch import save_file

    from polyspec.data.prepare import prepare_dataset
    from polyspec.decode.head import TOKEN_COUNTS_FILE

    path = out_dir / TOKEN_COUNTS_FILE
    if path.exists():
        return
    vocab = int(json.loads((out_dir / "config.json").read_text(encoding="utf-8"))["args"]["vocab_size"])
    counts = _token_counts(prepare_dataset(t.data, tokenizer, workdir=t.workdir, tokenizer_id=target_id), vocab)
    atomic_file(path, lambda tmp: save_file({"counts": counts}, str(tmp), metadata={"format": "pt"}))
    write_file_hashes(out_dir)


def _token_counts(prepared: Any, vocab_size: int) -> Any:
    """How often each token is a training target (train split, loss mask 1): what set_draft_vocab picks from."""
    from polyspec.decode.head import count_tokens

    return count_tokens(prepared.train["input_ids"], prepared.train["loss_mask"], vocab_size)


def _write_head(head, out_dir: Path, target_info: dict[str, Any], training: dict[str, Any],
                token_counts: Any = None) -> Path:
    """save_head (with the training targets' token counts) plus training.json and the files' hashes, written as one
    folder atomically (replacing a stale or damaged folder for the same key)."""
    from polyspec.decode.head import save_head

    def write(tmp: Path) -> None:
        save_head(head, tmp, target_info, token_counts)
        (tmp / TRAINING_JSON).write_text(json.dumps(training, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        tmp.chmod(0o755)

    return atomic_folder(out_dir, write, hashes=True)


def _acceptance_probe(cfg: TrainConfig, draft: Any, teacher, prepared, tokenizer: Any):
    """A function head -> {heldout/accept_linear, heldout/accept_tree, heldout/accept_depth<j>}: the decoder's tokens
    per target verification (and the linear drafts' acceptance of draft token j given 1..j-1)
    on the first ``train.accept_prompts`` held-out prompts (greedy dual, linear drafts of ``decode.draft.k`` and the
    recipe's tree shape, else the default shape); None when turned off or nothing is held out."""
    import torch

    from polyspec.chain_spec import DraftSpec, TreeShape
    from polyspec.decode.acceptance import decoder_acceptance, prompt_prefix
    from polyspec.decode.generate import eos_ids

    if not cfg.accept_prompts:
        return None
    rows = (prompt_prefix(r["input_ids"], r["loss_mask"]) for r in prepared.heldout)
    prompts = list(itertools.islice((p for p in rows if p), cfg.accept_prompts))  # reads only the rows it needs
    if not prompts:
        return None
    linear = DraftSpec(k=draft.k)
    tree = linear.model_copy(update={"tree": draft.tree or TreeShape()})
    eos = frozenset(eos_ids(tokenizer))

    def probe(head) -> dict[str, float]:
        device = next(head.parameters()).device
        teacher.to(device)
        was_training = head.training
        head.eval()
        out = {}
        with torch.autocast(device.type, dtype=teacher.norm.weight.dtype,
                            enabled=teacher.norm.weight.dtype != next(head.parameters()).dtype):
            for name, draft in (("linear", linear), ("tree", tree)):
                res = decoder_acceptance(teacher, head, prompts, max_new_tokens=ACCEPT_TOKENS, draft=draft,
                                         eos_token_ids=eos)
                out[f"heldout/accept_{name}"] = res.tokens_per_verification
                out.update({f"heldout/accept_depth{j}": a for j, a in enumerate(res.depth_accept, 1)})
        head.train(was_training)
        return out

    return probe


def head_settings(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with the head's defaults (EAGLE3_DEFAULTS, or EAGLE_DEFAULTS for EAGLE-1/2) filled in where the recipe
    leaves them unset."""
    defaults = EAGLE3_DEFAULTS if cfg.head in EAGLE3_TYPES else EAGLE_DEFAULTS
    return cfg.model_copy(update={k: v for k, v in defaults.items() if getattr(cfg, k) is None})


def _aux_layers(cfg: TrainConfig, teacher) -> list[int]:
    """The target layers an EAGLE-3 head fuses (train.aux_layers, else the default for the target's depth), checked;
    [] for an EAGLE-1/2 head."""
    from polyspec.decode.head3 import default_aux_layers

    if cfg.head not in EAGLE3_TYPES:
        return []
    n = teacher.args.num_layers
    aux = cfg.aux_layers if cfg.aux_layers is not None else default_aux_layers(n)
    if any(not 0 <= i < n for i in aux):
        raise PolyspecError(f"train.aux_layers {aux} must lie in 0..{n - 1} (the target has {n} layers); the default "
                            f"for it is {default_aux_layers(n)}", exit_code=2)
    return list(aux)


def _new_head(cfg: TrainConfig, teacher, counts: Any):
    """A fresh head for ``cfg.head``: EAGLE-1/2 over the teacher's embedding and lm_head, or EAGLE-3 / 3.1 with its
    draft vocabulary (the most frequent training tokens) and lm_head / norm started from the teacher's."""
    from polyspec.decode.head import EagleHead
    from polyspec.decode.head3 import Eagle3Head, draft_vocab_ids, init_from_target

    args = dataclasses.replace(teacher.args, num_layers=1)
    if cfg.head == "eagle":
        return EagleHead(args, teacher.embed_tokens, teacher.lm_head).float()
    aux = _aux_layers(cfg, teacher)
    size = min(cfg.draft_vocab, args.vocab_size)
    head = Eagle3Head(args, teacher.embed_tokens, aux, size, cfg.head).float()
    return init_from_target(head, teacher, draft_vocab_ids(counts, size))


def _fit(train: TrainConfig, t: TrainInputs, runtime: dict[str, Any], teacher, prepared, cache_info: dict[str, Any], key: str,
         tracker: Any, progress: bool, callbacks: Sequence[Any], log_every: int, probe: Any, counts: Any
         ) -> dict[str, Any]:
    """Build the LightningModule, loaders and Trainer, fit (resuming), evaluate; return the run's numbers.
    ``probe``: the decoder's acceptance after each validation (rank 0; or None). ``counts``: the training targets'
    token counts (the draft vocabulary, train.draft_vocab, comes from them)."""
    import warnings

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint, TQDMProgressBar

    from polyspec.train.module import HeadModule, TrackerCallback

    # the shared embedding / lm_head are frozen eval-mode modules on purpose
    warnings.filterwarnings("ignore", message=".*module\\(s\\) in eval mode.*")
    cfg = head_settings(train)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    head = _new_head(cfg, teacher, counts)
    module = HeadModule(head, cfg, draft_k=t.draft.k,
                        teacher=teacher if cfg.features == "online" or cfg.head in EAGLE3_TYPES else None, probe=probe,
                        loss_ids=_loss_ids(cfg, counts))

    train_dl, val_dl = _loaders(cfg, prepared, cache_info)
    state_dir = Path(t.workdir) / "train" / key[:16]
    ckpt_dir = state_dir / "checkpoints"
    world = _world_size(runtime)
    logger_cb = TrackerCallback(tracker, log_every, world)
    ckpt_cb = ModelCheckpoint(dirpath=ckpt_dir, filename="step-{step:08d}", auto_insert_metric_name=False,
                              every_n_train_steps=cfg.checkpoint_every, save_top_k=1, save_last=False,
                              save_on_train_epoch_end=False)
    cbs: list[Any] = [ckpt_cb, logger_cb, *callbacks]
    if progress:
        cbs.append(_progress_callback(TQDMProgressBar))
    trainer = _trainer(cfg, runtime, cbs, progress, state_dir, has_val=val_dl is not None,
                       interval=_val_interval(cfg, len(train_dl), world), log_every=log_every)
    resume = latest_checkpoint(ckpt_dir)
    if resume is not None and trainer.is_global_zero:
        _say(progress, f"train: resuming from {resume}")
    t0 = time.perf_counter()
    trainer.fit(module, train_dataloaders=train_dl, val_dataloaders=val_dl, ckpt_path=str(resume) if resume else None)
    wall = time.perf_counter() - t0
    _check_finished(trainer, cfg, ckpt_dir)
    train_seconds = time.perf_counter() - logger_cb.start_time
    tokens_this_run = (module.tokens_seen - logger_cb.start_tokens) * world
    if val_dl is not None and module.last_eval.get("step") != float(trainer.global_step):
        trainer.validate(module, dataloaders=val_dl, verbose=False)
        logger_cb.on_validation_end(trainer, module)  # validate() alone does not run the fit-time callback path
    numbers = {"steps": int(trainer.global_step), "epochs_completed": int(trainer.current_epoch),
               "resumed_from": str(resume) if resume else None, "fit_seconds": wall,
               "tokens_seen": int(module.tokens_seen) * world, "tokens_this_run": int(tokens_this_run),
               "tokens_per_second": tokens_this_run / max(train_seconds, 1e-9)}
    return _fit_result(numbers, module, logger_cb, t.draft.k)


def _trainer(cfg: Any, runtime: dict[str, Any], callbacks: list[Any], progress: bool, state_dir: Path, *,
             has_val: bool, interval: tuple[Any, Any], log_every: int) -> Any:
    """The Lightning Trainer of a fit: the runtime's accelerator, devices, strategy and precision; ``interval``:
    (val_check_interval, check_val_every_n_epoch)."""
    import lightning as L

    from polyspec.train.module import SafetensorsCheckpointIO

    plugins = [] if runtime["strategy"].startswith("deepspeed") else [SafetensorsCheckpointIO()]
    return L.Trainer(
        accelerator=runtime["accelerator"], devices=runtime["devices"], strategy=runtime["strategy"],
        precision=runtime["precision"], max_epochs=cfg.epochs, max_steps=cfg.max_steps or -1,
        max_time=datetime.timedelta(minutes=cfg.max_minutes) if cfg.max_minutes else None,
        accumulate_grad_batches=cfg.grad_accum, gradient_clip_val=cfg.grad_clip, gradient_clip_algorithm="norm",
        callbacks=callbacks, plugins=plugins, logger=False, enable_progress_bar=progress, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=1.0 if has_val else 0,
        **dict(zip(("val_check_interval", "check_val_every_n_epoch"), interval, strict=True)),
        default_root_dir=str(state_dir), log_every_n_steps=log_every, use_distributed_sampler=True,
    )


def _check_finished(trainer: Any, cfg: Any, ckpt_dir: Path) -> None:
    """Refuse a fit that returned early (a signal Lightning handled): its state is saved, never a short head."""
    finished = (cfg.max_steps is not None and trainer.global_step >= cfg.max_steps) or \
        trainer.current_epoch >= cfg.epochs or _budget_spent(trainer)
    if not finished:
        trainer.save_checkpoint(ckpt_dir / f"step-{trainer.global_step:08d}.ckpt")
        raise PolyspecError(f"training stopped early at step {trainer.global_step}; its state is saved in {ckpt_dir}: "
                            "run the same command again to resume", exit_code=1)


def _fit_result(numbers: dict[str, Any], module: Any, logger_cb: Any, draft_k: int) -> dict[str, Any]:
    """The fit's numbers for training.json: ``numbers`` plus the losses, the held-out metrics and the decoder's
    acceptance (the last validation's), and the trained head under "_head"."""
    history, last = logger_cb.history, module.last_eval
    result: dict[str, Any] = {
        **numbers,
        "train_loss_first": history[0]["train/loss"] if history else None,
        "train_loss_last": history[-1]["train/loss"] if history else None,
        "heldout": {k.removeprefix("heldout/"): v for k, v in last.items()},
        "eval_history": logger_cb.evals,
        "_head": module.head,
    }
    if last:
        result["heldout_top1_agreement"] = last["heldout/top1_agreement"]
        result["acceptance_length_estimate"] = last["heldout/acceptance_length_estimate"]
        for name in ("accept_linear", "accept_tree"):
            if f"heldout/{name}" in last:
                result[f"decoder_{name}"] = last[f"heldout/{name}"]
        depths = [last[f"heldout/accept_depth{j}"] for j in range(1, draft_k + 1) if f"heldout/accept_depth{j}" in last]
        if depths:
            result["decoder_accept_depths"] = depths
    return result


def _loaders(cfg: TrainConfig, prepared: Any, cache_info: dict[str, Any]) -> tuple[Any, Any]:
    """The training DataLoader (shuffled, seeded) and the held-out one (None when nothing is held out), over token
    rows (online) or the offline feature cache."""
    import torch

    from polyspec.train.features import CachedFeatureDataset, TokenDataset, collate

    if cfg.features == "offline":
        cache_dir = Path(cache_info["cache_dir"])
        train_ds = CachedFeatureDataset(cache_dir, "train")
        val_ds = CachedFeatureDataset(cache_dir, "heldout") if len(prepared.heldout) else None
    else:
        train_ds = TokenDataset(prepared.train)
        val_ds = TokenDataset(prepared.heldout) if len(prepared.heldout) else None
    gen = torch.Generator().manual_seed(cfg.seed)
    train_dl = torch.utils.data.DataLoader(train_ds, batch_size=cfg.batch_size, shuffle=True, generator=gen,
                                           collate_fn=collate)
    val_dl = (torch.utils.data.DataLoader(val_ds, batch_size=cfg.batch_size, shuffle=False, collate_fn=collate)
              if val_ds is not None else None)
    return train_dl, val_dl


def _loss_ids(cfg: TrainConfig, counts: Any) -> Any:
    """An EAGLE-1/2 head's train.draft_vocab token ids (the token loss's columns): the most frequent training
    targets, as decode.draft.vocab picks them; None for the full vocabulary (and for EAGLE-3, whose lm_head has its
    own rows)."""
    if cfg.head != "eagle" or not cfg.draft_vocab:
        return None
    if cfg.draft_vocab > counts.numel():
        raise PolyspecError(f"train.draft_vocab={cfg.draft_vocab} exceeds the target's vocabulary ({counts.numel()} "
                            "tokens); use at most that, or 0 for the full vocabulary", exit_code=2)
    from polyspec.decode.head import top_token_ids

    return top_token_ids(counts, cfg.draft_vocab)


def _budget_spent(trainer: Any) -> bool:
    """Whether Lightning's Timer (train.max_minutes; its elapsed time survives a resume) ended the fit."""
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    return timer is not None and timer.time_remaining("train") is not None and timer.time_remaining("train") <= 0


def _val_interval(cfg: TrainConfig, batches: int, world: int) -> tuple[int | float, int]:
    """Lightning's (val_check_interval, check_val_every_n_epoch) for ``train.eval_every`` optimizer steps: within an
    epoch a batch count per rank; for epochs shorter than that, every so many whole epochs; (1.0, 1) (once per epoch)
    when unset."""
    if cfg.eval_every is None:
        return 1.0, 1
    per_rank = max(1, batches // max(world, 1))
    interval = cfg.eval_every * cfg.grad_accum
    if interval < per_rank:
        return interval, 1
    return 1.0, max(1, round(interval / per_rank))


def _world_size(runtime: dict[str, Any]) -> int:
    devices = runtime["devices"]
    if isinstance(devices, int):
        return devices
    if isinstance(devices, list):
        return len(devices)
    import torch

    return max(1, torch.cuda.device_count()) if runtime["accelerator"] == "gpu" else 1
