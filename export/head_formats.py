"""A chain's draft head in a serving engine's own format (``polyspec chain export-head``).

Engines that outgrow one machine (vLLM, SGLang) serve a target with one EAGLE draft head; each reads its own folder
layout. The formats, and the loader each was checked against (see docs/SERVE.md, "Serving the head with vLLM /
SGLang"):

* ``speculators`` (vllm-project/speculators' ``eagle3`` model, what ``vllm serve DIR`` takes): ``config.json``
  (``speculators_model_type`` eagle3, ``transformer_layer_config``, ``speculators_config``, ...) and
  ``model.safetensors`` with ``fc``, ``layers.0.*``, ``norm``, ``lm_head`` [Vd, H], ``d2t`` int64 [Vd] (target id -
  draft id), ``t2d`` bool [V]; an EAGLE-3.1 head also ``fc_norm.{i}.weight`` and ``"fc_norm": true, "norm_output":
  true`` (vLLM releases with EAGLE-3.1 support read both). EAGLE-3 heads only: speculators has no EAGLE-1/2 model
  type any more, and vLLM's EAGLE-1 loader has neither the fc bias nor the layer-0 input norm polyspec's EAGLE-1/2
  heads use.
* ``sglang``: an EAGLE-3 head as SpecForge writes it for ``LlamaForCausalLMEagle3`` (``midlayer.*``, aux layers in
  ``eagle_config``; an EAGLE-3.1 head also ``fc_norm.{i}.weight`` and top-level ``fc_norm`` / ``norm_output``, which
  SGLang releases before its EAGLE-3.1 support ignore without a word); an EAGLE-1/2 head as ``LlamaForCausalLMEagle``
  reads it, plus FR-Spec's token map (``hot_token_map.pt``: the draft vocabulary's token ids, for
  ``--speculative-token-map``).
* ``eagle`` (SafeAILab/EAGLE's ``ea_model`` folder): ``config.json`` + ``model.safetensors`` (EAGLE reads it when
  there is no ``pytorch_model.bin``), EAGLE-1/2 (``fc``, ``layers.N.*``) or EAGLE-3 (``midlayer.*``) names. EAGLE
  takes the embedding from the target folder (``base_model_path``) through its ``model.safetensors.index.json`` only,
  so the export makes sure the target it names has one (:func:`eagle_target_index`). EAGLE's model has no EAGLE-3.1
  norms: an EAGLE-3.1 head is refused.

**EAGLE-1/2 heads, exactly.** polyspec's layer normalises its input (EAGLE's first layer does not) and fc has a bias
(SGLang's and EAGLE's fc do too). The folder therefore holds two layers: layer 0, which those loaders build without
an input norm, has all-zero projections, so it passes its input through unchanged (attention and MLP add exactly 0),
and layer 1 is polyspec's layer with its input norm. The engine computes the head's own function, at the cost of one
layer of zero weights.

The embedding (and for EAGLE-1/2 the lm_head) is never written: every engine here shares the target's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from polyspec.chain_spec import EAGLE3_TYPES
from polyspec.errors import PolyspecError

if TYPE_CHECKING:  # torch is imported where it is used: the CLI reads FORMATS without loading it
    import torch

FORMATS = ("speculators", "sglang", "eagle")
SPECULATORS_VERSION = "0.9.0"  # the speculators release whose eagle3 layout these files match (tests load them)
TOKEN_MAP_FILE = "hot_token_map.pt"  # SGLang's --speculative-token-map reads it with torch.load(weights_only=True)
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


@dataclass
class HeadSource:
    """What an export needs from a chain: its head's tensors and shape, and the target it drafts for."""

    level: str  # the chain level's name, for messages
    kind: str  # "eagle" (EAGLE-1/2), "eagle3" or "eagle3.1" (chain_spec.HEAD_TYPES)
    args: Any  # decode.model.ModelArgs of the head's layer
    tensors: dict[str, torch.Tensor]  # the head folder's tensors, polyspec's names
    target_layers: int
    verifier: str  # the target, as the engine should load it
    verifier_architectures: list[str]
    draft_k: int
    aux_layers: list[int] = field(default_factory=list)  # EAGLE-3: 0-based layers whose outputs the head fuses
    token_counts: torch.Tensor | None = None  # int64 [V]: the head's training token counts, if its folder has them
    draft_vocab: int = 0  # EAGLE-1/2: the token map's size (0: none)


@dataclass
class HeadExport:
    config: dict[str, Any]
    tensors: dict[str, torch.Tensor]
    token_map: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------------------------
# Reading the chain


def read_head_source(chain: Path, *, verifier: str | None = None, draft_vocab: int | None = None,
                     hashes: bool = True) -> HeadSource:
    """The chain's head (hashes checked unless ``hashes`` is False: a writer that has just hashed them) and its
    target. ``verifier`` defaults to the chain's target folder; ``draft_vocab`` (EAGLE-1/2: the token map's size,
    0 = none) to the manifest's ``decode.draft.vocab``."""
    from polyspec.decode.head import head_type, read_head_config, read_token_counts
    from polyspec.decode.model import ModelArgs, read_json_object
    from polyspec.weights import load_safetensors

    manifest, level, head_dir, target_dir = _head_and_target(Path(chain), hashes)
    cfg = read_head_config(head_dir)
    args = ModelArgs.from_dict(cfg["args"])
    target_cfg = read_json_object(target_dir / "config.json")
    return HeadSource(
        level=level, kind=head_type(cfg), args=args, tensors=load_safetensors(head_dir / WEIGHTS_FILE),
        target_layers=int(target_cfg.get("num_hidden_layers", 0)),
        verifier=verifier or str(target_dir.resolve()),
        verifier_architectures=list(target_cfg.get("architectures") or ["LlamaForCausalLM"]),
        draft_k=max(manifest.decode.draft.depth, 1), aux_layers=list(cfg.get("aux_layers") or []),
        token_counts=read_token_counts(head_dir, args.vocab_size),
        draft_vocab=manifest.decode.draft.vocab if draft_vocab is None else draft_vocab)


def _head_and_target(chain: Path, hashes: bool = True) -> tuple[Any, str, Path, Path]:
    """(manifest, the head level's name, its folder, the target's folder) of a chain that validates."""
    from polyspec.manifest import level_folders, validate_chain

    manifest = validate_chain(chain, hashes=hashes)
    folders = level_folders(chain, manifest)
    heads = [i for i, lv in enumerate(manifest.levels) if lv.kind == "head"]
    if not heads:
        raise PolyspecError(f"chain {chain} has no draft head level (levels: "
                            f"{[lv.name for lv in manifest.levels]}); assemble one with --draft")
    return manifest, manifest.levels[heads[-1]].name, folders[heads[-1]], folders[0]


def token_map(src: HeadSource) -> torch.Tensor | None:
    """FR-Spec's hot token ids for an EAGLE-1/2 head: its ``draft_vocab`` most frequent training tokens (ascending,
    as polyspec's draft vocabulary), or None for 0."""
    from polyspec.decode.head import top_token_ids

    size = src.draft_vocab
    if not size:
        return None
    if src.token_counts is None:
        raise PolyspecError(f"the head (chain level {src.level!r}) has no token counts, so no draft vocabulary of "
                            f"{size} tokens can be picked for the token map; pass --draft-vocab 0 (no token map)")
    if not 0 < size <= src.args.vocab_size:
        raise PolyspecError(f"--draft-vocab must be in 0..{src.args.vocab_size}, got {size}")
    return top_token_ids(src.token_counts, size)


# ---------------------------------------------------------------------------------------------------------------
# What each format can hold


def refusal(src: HeadSource, fmt: str) -> str | None:
    """Why ``src`` cannot be written exactly in ``fmt`` (None: it can)."""
    a = src.args
    if fmt == "speculators" and src.kind == "eagle":
        return ("speculators holds EAGLE-3-family heads only (its eagle3 model; the EAGLE-1/HASS type is gone), and "
                "vLLM's EAGLE-1 loader has no fc bias and no layer-0 input norm, both of which this EAGLE-1/2 head "
                "uses; --format sglang or --format eagle write it exactly, or train an EAGLE-3 head (train.head: "
                "eagle3) for vLLM")
    if src.kind in EAGLE3_TYPES and len(set(src.aux_layers)) != 3:
        return (f"the head fuses the target layers {src.aux_layers}; vLLM, SGLang and EAGLE build fc for exactly 3 "
                "distinct layers (each engine captures a layer once), so train.aux_layers needs three different "
                "layers (a target of 7 or more layers gets them by default)")
    if fmt in ("sglang", "eagle") and (a.attention_bias or a.has_o_bias or a.mlp_bias):
        return (f"the head's layer has biases (attention {a.attention_bias}, mlp {a.mlp_bias}) that "
                f"{'SGLang' if fmt == 'sglang' else 'EAGLE'}'s draft layer does not load; --format speculators "
                "takes them (EAGLE-3 heads)")
    if fmt == "eagle":
        return _eagle_refusal(src)
    return None


def _eagle31(src: HeadSource) -> bool:
    """Whether the head has EAGLE-3.1's fc_norm and norm_output (decode/head3.py)."""
    return src.kind == "eagle3.1"


def _eagle_refusal(src: HeadSource) -> str | None:
    """SafeAILab/EAGLE's draft layer: head_dim = hidden / heads, RoPE without scaling (its scaled RoPE ignores
    rope_theta), and for EAGLE-3 the target layers its base model hard-codes."""
    a = src.args
    if _eagle31(src):
        return ("EAGLE's EAGLE-3 model has neither the per-layer fc_norm nor the normalised state fed back "
                "(norm_output) of this EAGLE-3.1 head; --format speculators or sglang carry both")
    if a.head_dim * a.num_heads != a.hidden_size:
        return f"EAGLE's attention takes head_dim = hidden / heads; this head has head_dim {a.head_dim}"
    if a.rope_scaling:
        return f"EAGLE's draft layer does not reproduce RoPE scaling {a.rope_scaling}; --format sglang does"
    n = src.target_layers
    fixed = [1, n // 2 - 1, n - 4]  # EAGLE's base model keeps the inputs of layers 2, N/2 and N - 3
    if src.kind in EAGLE3_TYPES and sorted(src.aux_layers) != sorted(fixed):
        return (f"EAGLE's base model feeds an EAGLE-3 head the outputs of layers {fixed}, this head reads "
                f"{src.aux_layers}; --format sglang or speculators take any three layers")
    return None


# ---------------------------------------------------------------------------------------------------------------
# Configs and tensors


def _dtype_name(tensors: dict[str, torch.Tensor]) -> str:
    return str(tensors["fc.weight"].dtype).removeprefix("torch.")


def llama_config(args: Any, *, layers: int, dtype: str) -> dict[str, Any]:
    """A Hugging Face Llama config for the draft's layers. tie_word_embeddings is false whatever the target says:
    the draft's lm_head slot is its own (EAGLE-3) or filled with the target's rows (EAGLE-1/2), never its embedding."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": args.vocab_size,
        "hidden_size": args.hidden_size, "intermediate_size": args.intermediate_size, "num_hidden_layers": layers,
        "num_attention_heads": args.num_heads, "num_key_value_heads": args.num_kv_heads, "head_dim": args.head_dim,
        "hidden_act": "silu", "max_position_embeddings": args.max_position_embeddings,
        "rms_norm_eps": args.rms_norm_eps, "rope_theta": args.rope_theta, "rope_scaling": args.rope_scaling,
        "attention_bias": bool(args.attention_bias or args.has_o_bias), "mlp_bias": bool(args.mlp_bias),
        "tie_word_embeddings": False, "torch_dtype": dtype, "use_cache": True,
    }


def eagle3_tensors(src: HeadSource, layer_prefix: str, *, vocab_maps: bool = True) -> dict[str, torch.Tensor]:
    """The EAGLE-3 head's tensors with its layer under ``layer_prefix`` ("layers.0." or "midlayer."), fc's input
    blocks in ascending layer order (the configs list the layers sorted). A layer with some attention biases gets
    the others as zeros (Qwen2: q/k/v but no o_proj bias): the engines' attention_bias gives all four one."""
    import torch

    out = {(layer_prefix + k.removeprefix("layer.") if k.startswith("layer.") else k): v.contiguous()
           for k, v in src.tensors.items() if vocab_maps or k not in ("d2t", "t2d")}
    order = sorted(range(len(src.aux_layers)), key=src.aux_layers.__getitem__)
    # engines concatenate the captured layers in layer order: fc's input blocks (and EAGLE-3.1's fc_norms) follow it
    blocks = out["fc.weight"].chunk(len(order), dim=1)  # [H, H] per aux layer, in the head's order
    out["fc.weight"] = torch.cat([blocks[i] for i in order], dim=1).contiguous()
    if _eagle31(src):
        norms = [out.pop(f"fc_norm.{i}.weight") for i in range(len(order))]
        out |= {f"fc_norm.{j}.weight": norms[i] for j, i in enumerate(order)}
    a = src.args
    if a.attention_bias or a.has_o_bias:  # the config's attention_bias gives q, k, v and o_proj a bias each
        sizes = {"q": a.num_heads * a.head_dim, "k": a.num_kv_heads * a.head_dim, "v": a.num_kv_heads * a.head_dim,
                 "o": a.hidden_size}
        for p, n in sizes.items():
            out.setdefault(f"{layer_prefix}self_attn.{p}_proj.bias", torch.zeros(n, dtype=out["fc.weight"].dtype))
    return out


def eagle1_tensors(src: HeadSource) -> dict[str, torch.Tensor]:
    """An EAGLE-1/2 head as two EAGLE layers (module docstring): ``layers.0`` passes its input through (zero
    projections; EAGLE's layer 0 has no input norm), ``layers.1`` is the head's layer, fc keeps its bias."""
    import torch

    a = src.args
    dt = src.tensors["fc.weight"].dtype
    h, q, kv, i = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate_size
    shapes = {"self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
              "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
              "mlp.gate_proj.weight": (i, h), "mlp.up_proj.weight": (i, h), "mlp.down_proj.weight": (h, i)}
    out = {f"layers.0.{k}": torch.zeros(s, dtype=dt) for k, s in shapes.items()}
    out["layers.0.post_attention_layernorm.weight"] = torch.ones(h, dtype=dt)  # its MLP output is 0 whatever it is
    for k, v in src.tensors.items():
        out["layers.1." + k.removeprefix("layer.") if k.startswith("layer.") else k] = v.contiguous()
    return out


# ---------------------------------------------------------------------------------------------------------------
# The formats


def build_speculators(src: HeadSource) -> HeadExport:
    """vllm-project/speculators' eagle3 config (as ``Eagle3SpeculatorConfig`` serialises it) and weights."""
    a = src.args
    vd = int(src.tensors["lm_head.weight"].shape[0])
    layer = llama_config(a, layers=1, dtype=_dtype_name(src.tensors))
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer,
        "draft_vocab_size": vd, "target_hidden_size": a.hidden_size,
        # speculators / vLLM count the inputs of layers, polyspec the outputs: + 1
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in sorted(src.aux_layers)],
        # polyspec's residual is the un-normalised hidden state; vLLM reads a missing key as true
        "norm_before_residual": False, "norm_before_fc": False, "fc_norm": _eagle31(src),
        "norm_output": _eagle31(src),
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": src.draft_k,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": src.verifier, "architectures": src.verifier_architectures},
        },
    }
    # speculators keeps no vocabulary maps when the draft vocabulary is the whole vocabulary
    return HeadExport(config, eagle3_tensors(src, "layers.0.", vocab_maps=vd != a.vocab_size))


def build_sglang(src: HeadSource) -> HeadExport:
    """SGLang's ``LlamaForCausalLMEagle3`` (SpecForge's export) or ``LlamaForCausalLMEagle`` + FR-Spec token map."""
    dtype = _dtype_name(src.tensors)
    if src.kind in EAGLE3_TYPES:
        config = llama_config(src.args, layers=1, dtype=dtype)
        if _eagle31(src):  # SGLang's LlamaForCausalLMEagle3 reads both from the top level
            config.update(fc_norm=True, norm_output=True)
        config.update(architectures=["LlamaForCausalLMEagle3"],
                      draft_vocab_size=int(src.tensors["lm_head.weight"].shape[0]),
                      target_hidden_size=src.args.hidden_size,
                      # SGLang and SpecForge count layer outputs, as polyspec does (SGLang adds the 1 itself)
                      eagle_config={"eagle_aux_hidden_state_layer_ids": sorted(src.aux_layers)})
        return HeadExport(config, eagle3_tensors(src, "midlayer."))
    config = llama_config(src.args, layers=2, dtype=dtype)
    config["architectures"] = ["LlamaForCausalLMEagle"]
    return HeadExport(config, eagle1_tensors(src), token_map=token_map(src))


def build_eagle(src: HeadSource) -> HeadExport:
    """SafeAILab/EAGLE's draft folder: ``bias`` true (fc has one) for EAGLE-1/2, ``draft_vocab_size`` for EAGLE-3."""
    dtype = _dtype_name(src.tensors)
    if src.kind in EAGLE3_TYPES:
        config = llama_config(src.args, layers=1, dtype=dtype)
        config["draft_vocab_size"] = int(src.tensors["lm_head.weight"].shape[0])
        return HeadExport(config, eagle3_tensors(src, "midlayer."))
    config = llama_config(src.args, layers=2, dtype=dtype)
    config["bias"] = True
    return HeadExport(config, eagle1_tensors(src))


BUILDERS = {"speculators": build_speculators, "sglang": build_sglang, "eagle": build_eagle}


def build_export(src: HeadSource, fmt: str) -> HeadExport:
    """The folder contents of ``src`` in ``fmt``, or one PolyspecError saying why it cannot be written exactly."""
    if fmt not in BUILDERS:
        raise PolyspecError(f"unknown head format {fmt!r}; choose one of {list(FORMATS)}")
    why = refusal(src, fmt)
    if why:
        kind = {"eagle3": "EAGLE-3", "eagle3.1": "EAGLE-3.1"}.get(src.kind, "EAGLE-1/2")
        raise PolyspecError(f"cannot write the {kind} head (chain level {src.level!r}) in the {fmt} format: {why}")
    return BUILDERS[fmt](src)


def write_export(exp: HeadExport, out: Path) -> Path:
    """Write the folder atomically (built beside ``out``, then swapped in)."""
    import torch
    from safetensors.torch import save

    from polyspec.fsutil import atomic_folder

    def write(tmp: Path) -> None:
        (tmp / CONFIG_FILE).write_text(json.dumps(exp.config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        # serialised here, written by Python: a full disk is an OSError (one clear error), not a SafetensorError
        (tmp / WEIGHTS_FILE).write_bytes(save(exp.tensors, metadata={"format": "pt"}))
        if exp.token_map is not None:
            torch.save(exp.token_map.to(torch.int64).clone(), tmp / TOKEN_MAP_FILE)
        # a temporary folder is private (0700): an engine may run as another user or in a container
        for f in tmp.iterdir():
            f.chmod(0o644)
        tmp.chmod(0o755)

    return atomic_folder(out, write)


def export_head(chain: Path, fmt: str, out: Path, *, verifier: str | None = None, draft_vocab: int | None = None,
                overwrite: bool = False) -> Path:
    """Write the chain's draft head to ``out`` in ``fmt`` (one of FORMATS); every refusal comes before any write."""
    from polyspec.fsutil import check_replaceable

    out = Path(out)
    check_replaceable(out, flag="--out", overwrite=overwrite, own=_not_an_export, keep=[chain])
    if fmt not in FORMATS:
        raise PolyspecError(f"unknown head format {fmt!r}; choose one of {list(FORMATS)}")
    src = read_head_source(chain, verifier=verifier, draft_vocab=draft_vocab)
    exp = build_export(src, fmt)
    if fmt == "eagle":
        eagle_target_index(Path(src.verifier), Path(chain))
    return write_export(exp, out)


# The engine folders an export writes inside the chain (``engines/<name>``), each in its engine's head format
ENGINES = {"vllm": "speculators", "sglang": "sglang", "eagle": "eagle"}


def write_engines(chain: Path, verifier: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Write the chain's draft head into ``chain/engines/<engine>`` in every format of :data:`ENGINES` it can be
    written in exactly; returns ({engine: EngineEntry}, {engine: why not} for the rest). ``verifier``: the target
    folder the engines should load (the chain's final place, not the folder being written). No FR-Spec token map:
    a chain holds no pickle (``polyspec chain export-head --format sglang`` writes one)."""
    from polyspec.chain_spec import EngineEntry
    from polyspec.manifest import hash_folder, read_manifest

    if not any(lv.kind == "head" for lv in read_manifest(chain).levels):
        return {}, {}
    src = read_head_source(chain, verifier=verifier, draft_vocab=0, hashes=False)
    written, refused = {}, {}
    for engine, fmt in ENGINES.items():
        why = refusal(src, fmt)
        if why:  # an EAGLE-1/2 head for vLLM: the one-line reason, not export-head's list of alternatives
            refused[engine] = ("vLLM loads EAGLE-3 heads only (train.head: eagle3)"
                               if fmt == "speculators" and src.kind == "eagle" else why)
            continue
        folder = Path(chain) / "engines" / engine
        folder.parent.mkdir(exist_ok=True)
        write_export(build_export(src, fmt), folder)
        written[engine] = EngineEntry(format=fmt, path=f"engines/{engine}", files=hash_folder(folder))
    return written, refused


def eagle_target_index(target: Path, chain: Path) -> Path | None:
    """The ``model.safetensors.index.json`` of the target EAGLE is given as ``base_model_path``: written beside a
    single ``model.safetensors`` when missing (a chain's target has it from ``assemble_chain``); None for a hub id,
    whose own repository must hold one. A chain's files are hashed, so one is never added inside a chain."""
    from polyspec.weights import INDEX_FILE, write_index

    if not target.is_dir() or (target / INDEX_FILE).is_file():
        return (target / INDEX_FILE) if target.is_dir() else None
    if target.resolve().is_relative_to(chain.resolve()):
        raise PolyspecError(f"{target} has no {INDEX_FILE} (the chain was assembled by an older polyspec) and EAGLE's "
                            "loader finds the target's embedding only through it: re-assemble the chain, or pass "
                            "--verifier a copy of the target folder (the index is written there)")
    index = write_index(target)
    if index is None:
        raise PolyspecError(f"{target} has neither {INDEX_FILE} nor a single model.safetensors; EAGLE's loader finds "
                            "the target's embedding only through that index")
    return index


def _not_an_export(folder: Path) -> list[str]:
    """The entries of ``folder`` that no head export writes (--overwrite replaces an earlier export only)."""
    return sorted(p.name for p in folder.iterdir() if p.name not in (CONFIG_FILE, WEIGHTS_FILE, TOKEN_MAP_FILE))


__all__ = ["FORMATS", "HeadSource", "HeadExport", "read_head_source", "refusal", "build_export", "write_export",
           "export_head", "eagle_target_index", "ENGINES", "write_engines", "llama_config", "eagle1_tensors", "eagle3_tensors", "token_map"]
