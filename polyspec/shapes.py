"""A level's config.json against its weights' tensor shapes, read from the safetensors headers alone (nothing is
allocated: a config that claims a million layers is refused before anything is built), and the levels of a chain
against each other. Used by :func:`polyspec.manifest.validate_chain`; no torch.

The layouts checked tensor by tensor: the Hugging Face Llama family as polyspec's engine reads it
(``model.layers.N.self_attn.q_proj.weight`` ...; decode/model.py), its GPTQ int4 copy (``qweight`` [in / 8, out],
``scales`` [groups, out]) and polyspec's EAGLE heads (``fc``, ``layer.*``; EAGLE-3 also ``lm_head``, ``d2t``,
``t2d``; EAGLE-3.1 ``fc_norm.*``). A model of another family (served through transformers) gets the checks every
decoder shares: its layer count against the layers its weights hold, its embedding against its vocabulary and hidden
sizes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from polyspec.chain_spec import EAGLE3_TYPES

Headers = dict[str, tuple[str, tuple[int, ...]]]  # tensor name -> (dtype, shape), over all of a level's files

HEAD_MODEL_TYPE = "polyspec-eagle-head"  # decode.head.HEAD_MODEL_TYPE (not imported: that loads torch)
LAYER_INDEX = re.compile(r"(?:^|\.)(?:layers|h|blocks|layer)\.(\d+)\.")
EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight")
ALIASES = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_hidden_layers": ("num_hidden_layers", "n_layer"),
           "num_attention_heads": ("num_attention_heads", "n_head"), "vocab_size": ("vocab_size",)}
MAX_PROBLEMS_PER_LEVEL = 4  # a config that is wrong is wrong in every layer: the first few say it


@dataclass
class Claims:
    """What a level's config says about the sizes other levels must agree with (None: not stated)."""

    vocab: int | None = None
    hidden: int | None = None
    layers: int | None = None
    head: bool = False
    aux_layers: tuple[int, ...] = ()


def _positive(cfg: dict[str, Any], key: str, where: str, problems: list[str], required: bool = False) -> int | None:
    """``cfg[key]`` (or its first alias present) as a positive integer; a problem when it is anything else."""
    name = next((k for k in ALIASES.get(key, (key,)) if k in cfg), None)
    if name is None:
        if required:
            problems.append(f"{where}: {key} is missing")
        return None
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(f"{where}: {name} must be a positive integer, got {value!r}")
        return None
    return value


def _shape_problem(headers: Headers, name: str, want: tuple[int, ...], why: str, where: str) -> str | None:
    got = headers.get(name)
    if got is None:
        return f"{where}: the weights have no tensor {name} (expected {list(want)}, from {why})"
    if tuple(got[1]) != want:
        return f"{where}: {name} is {list(got[1])}; config.json ({why}) makes it {list(want)}"
    return None


def _layer_indices(headers: Headers) -> set[int]:
    return {int(m.group(1)) for name in headers if (m := LAYER_INDEX.search(name))}


def _layer_count_problem(layers: int, headers: Headers, where: str) -> str | None:
    found = _layer_indices(headers)
    if len(found) == layers and (not found or (min(found) == 0 and max(found) == layers - 1)):
        return None
    held = f"layers {min(found)}..{max(found)} ({len(found)} layers)" if found else "no layer tensors"
    return f"{where}: num_hidden_layers {layers}, but its weights hold {held}"


def model_problems(cfg: dict[str, Any], headers: Headers, where: str) -> tuple[list[str], Claims]:
    """A model level's (target, int4 or other verifier) config.json against its tensors: sizes that are positive
    integers, the layer count, the embedding, and for the Llama layout every projection of every layer."""
    problems: list[str] = []
    sizes = {k: _positive(cfg, k, where, problems) for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                                                             "num_attention_heads", "num_key_value_heads",
                                                             "head_dim", "intermediate_size")}
    vocab, hidden, layers = sizes["vocab_size"], sizes["hidden_size"], sizes["num_hidden_layers"]
    claims = Claims(vocab=vocab, hidden=hidden, layers=layers)
    if problems:
        return problems, claims
    if layers is not None and (p := _layer_count_problem(layers, headers, where)):
        return [p], claims
    embed = next((n for n in headers if n.endswith(EMBEDDINGS)), None)
    if embed is not None and vocab and hidden:
        problems.append(_shape_problem(headers, embed, (vocab, hidden), f"vocab_size {vocab}, hidden_size {hidden}",
                                       where))
    if "lm_head.weight" in headers and vocab and hidden:
        problems.append(_shape_problem(headers, "lm_head.weight", (vocab, hidden),
                                       f"vocab_size {vocab}, hidden_size {hidden}", where))
    prefix = _llama_prefix(headers)
    if prefix is not None and not any(problems):
        problems += _llama_problems(cfg, sizes, headers, prefix, where)
    return [p for p in problems if p][:MAX_PROBLEMS_PER_LEVEL], claims


def _llama_prefix(headers: Headers) -> str | None:
    """``model.`` (or whatever comes before ``layers.N.``) when the weights use the Llama layout, else None."""
    for name in headers:
        m = re.match(r"^(.*?)layers\.\d+\.self_attn\.q_proj\.", name)
        if m:
            return m.group(1)
    return None


def _projections(h: int, q: int, kv: int, inter: int, q_in: int) -> dict[str, tuple[int, int]]:
    """(out, in) of each linear of a Llama decoder layer."""
    return {"self_attn.q_proj": (q, q_in), "self_attn.k_proj": (kv, q_in), "self_attn.v_proj": (kv, q_in),
            "self_attn.o_proj": (h, q), "mlp.gate_proj": (inter, h), "mlp.up_proj": (inter, h),
            "mlp.down_proj": (h, inter)}


def _attention_sizes(sizes: dict[str, int | None], where: str, keys: tuple[str, str, str, str]) -> tuple[int, int, int]:
    """(q out, kv out, head_dim) from hidden, heads, kv heads and head_dim; ValueError naming what is inconsistent."""
    hidden_key, heads_key, kv_key, dim_key = keys
    h, heads = sizes[hidden_key], sizes[heads_key]
    if h is None or heads is None:
        raise ValueError(f"{where}: {hidden_key} and {heads_key} are needed to check the attention weights")
    kv = sizes[kv_key] or heads
    if heads % kv:
        raise ValueError(f"{where}: {heads_key} {heads} is not a multiple of {kv_key} {kv}")
    dim = sizes[dim_key] or h // heads
    if dim < 1:
        raise ValueError(f"{where}: {hidden_key} {h} is smaller than {heads_key} {heads}")
    return heads * dim, kv * dim, dim


def _llama_problems(cfg: dict[str, Any], sizes: dict[str, int | None], headers: Headers, prefix: str,
                    where: str) -> list[str]:
    keys = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim")
    try:
        q, kv, _ = _attention_sizes(sizes, where, keys)
    except ValueError as exc:
        return [str(exc)]
    h, inter = sizes["hidden_size"], sizes["intermediate_size"]
    if inter is None:
        return [f"{where}: intermediate_size is missing"]
    heads = sizes["num_attention_heads"]
    why = f"hidden_size {h}, num_attention_heads {heads}, num_key_value_heads {sizes['num_key_value_heads'] or heads}"
    quant = cfg.get("quantization_config") or None
    problems = [_shape_problem(headers, f"{prefix}norm.weight", (h,), f"hidden_size {h}", where)]
    for i in range(sizes["num_hidden_layers"] or 0):
        problems += _layer_problems(headers, f"{prefix}layers.{i}.", _projections(h, q, kv, inter, h), h, quant,
                                    f"{why}, intermediate_size {inter}", where)
        if sum(p is not None for p in problems) >= MAX_PROBLEMS_PER_LEVEL:
            break
    return [p for p in problems if p]


def _layer_problems(headers: Headers, prefix: str, projections: dict[str, tuple[int, int]], h: int,
                    quant: dict[str, Any] | None, why: str, where: str) -> list[str | None]:
    """One decoder layer's norms and linears (plain, or GPTQ-packed when ``quant`` says so and the layer has them)."""
    problems = [_shape_problem(headers, f"{prefix}{n}.weight", (h,), f"hidden_size {h}", where)
                for n in ("input_layernorm", "post_attention_layernorm")]
    for sub, (out, inp) in projections.items():
        name = f"{prefix}{sub}"
        if quant and f"{name}.qweight" in headers:
            pack = 32 // int(quant.get("bits", 4) or 4)
            problems.append(_shape_problem(headers, f"{name}.qweight", (inp // pack, out), why, where))
            scales = headers.get(f"{name}.scales")
            if scales is not None and scales[1][-1:] != (out,):
                problems.append(f"{where}: {name}.scales is {list(scales[1])}; config.json ({why}) gives it {out} "
                                "columns")
        else:
            problems.append(_shape_problem(headers, f"{name}.weight", (out, inp), why, where))
    return problems


def head_problems(cfg: dict[str, Any], headers: Headers, where: str) -> tuple[list[str], Claims]:
    """A polyspec EAGLE head's config.json (its layer's ``args``) against its tensors."""
    problems: list[str] = []
    args = cfg.get("args")
    if not isinstance(args, dict):
        return [f"{where}: a head's config.json needs an 'args' object (its layer's sizes)"], Claims(head=True)
    sizes = {k: _positive(args, k, f"{where}: args", problems, required=k != "head_dim")
             for k in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size")}
    eagle3 = cfg.get("head_type", "eagle") in EAGLE3_TYPES
    aux = cfg.get("aux_layers") or []
    if eagle3 and not (isinstance(aux, list) and aux and all(isinstance(a, int) and a >= 0 for a in aux)):
        problems.append(f"{where}: aux_layers must be a non-empty list of layer indices >= 0, got {aux!r}")
    claims = Claims(vocab=sizes["vocab_size"], hidden=sizes["hidden_size"], head=True,
                    aux_layers=tuple(aux) if eagle3 and not problems else ())
    if problems:
        return problems, claims
    try:
        q, kv, _ = _attention_sizes(sizes, f"{where}: args", ("hidden_size", "num_heads", "num_kv_heads", "head_dim"))
    except ValueError as exc:
        return [str(exc)], claims
    h, v, inter = sizes["hidden_size"], sizes["vocab_size"], sizes["intermediate_size"]
    why = f"args: hidden_size {h}, num_heads {sizes['num_heads']}, intermediate_size {inter}"
    fc_in = len(aux) * h if eagle3 else 2 * h
    problems.append(_shape_problem(headers, "fc.weight", (h, fc_in), f"{why}, {'aux_layers' if eagle3 else 'eagle'}",
                                   where))
    problems += _layer_problems(headers, "layer.", _projections(h, q, kv, inter, 2 * h if eagle3 else h), h, None,
                                why, where)
    if eagle3:
        draft = _positive(cfg, "draft_vocab_size", where, problems, required=True) or 0
        problems.append(_shape_problem(headers, "lm_head.weight", (draft, h), f"draft_vocab_size {draft}, {why}",
                                       where))
        problems.append(_shape_problem(headers, "d2t", (draft,), f"draft_vocab_size {draft}", where))
        problems.append(_shape_problem(headers, "t2d", (v,), f"args: vocab_size {v}", where))
    if cfg.get("head_type") == "eagle3.1":  # one fc_norm per fused layer
        problems += [_shape_problem(headers, f"fc_norm.{i}.weight", (h,), f"hidden_size {h}, aux_layers", where)
                     for i in range(len(aux))]
    return [p for p in problems if p][:MAX_PROBLEMS_PER_LEVEL], claims


def level_problems(cfg: dict[str, Any], headers: Headers, where: str) -> tuple[list[str], Claims]:
    """:func:`head_problems` or :func:`model_problems`, by the config's model_type."""
    if cfg.get("model_type") == HEAD_MODEL_TYPE:
        return head_problems(cfg, headers, where)
    return model_problems(cfg, headers, where)


def chain_problems(names: list[str], claims: list[Claims | None], reads: list[str | None]) -> list[str]:
    """The levels against each other (top first): every level has the target's vocabulary (levels exchange token
    ids); a head reads a level above it and is made for the target's hidden size and vocabulary (it shares the
    target's embedding and lm_head), and an EAGLE-3 head fuses layers the target has."""
    top = claims[0]
    if top is None:
        return []
    problems = []
    for i, (name, c) in enumerate(zip(names, claims, strict=True)):
        if i == 0 or c is None:
            continue
        if c.head:
            problems += _head_against_target(i, name, c, claims, names, reads[i])
        elif c.vocab is not None and top.vocab is not None and c.vocab != top.vocab:
            problems.append(f"level {name}: vocab_size {c.vocab} differs from the target's {top.vocab}; every level "
                            "of a chain needs the target's vocabulary (levels exchange token ids)")
    return problems


def _head_against_target(i: int, name: str, c: Claims, claims: list[Claims | None], names: list[str],
                         reads: str | None) -> list[str]:
    top_name, top = names[0], claims[0]
    problems = []
    if reads not in names[:i]:
        problems.append(f"level {name}: reads_features_from = {reads!r} names no level above it (levels above: "
                        f"{names[:i]})")
    if any(mine is not None and theirs is not None and mine != theirs
           for mine, theirs in ((c.hidden, top.hidden), (c.vocab, top.vocab))):
        problems.append(f"level {name}: the head is made for hidden size {c.hidden} and vocabulary {c.vocab}, its "
                        f"target (level {top_name}) has hidden size {top.hidden} and vocabulary {top.vocab}; train a "
                        "head for this target")
    fed = claims[names.index(reads)] if reads in names[1:i] else None
    if fed is not None and None not in (fed.hidden, c.hidden) and fed.hidden != c.hidden:
        # the head takes its features from this verifier, not from the target: their widths must agree too
        problems.append(f"level {name}: reads features of hidden size {fed.hidden} from level {reads}, the head is "
                        f"made for hidden size {c.hidden}; read the target's features or train a head for {reads}")
    bad = [a for a in c.aux_layers if top.layers is not None and a >= top.layers]
    if bad:
        problems.append(f"level {name}: the EAGLE-3 head fuses target layers {list(c.aux_layers)}, the target "
                        f"(level {top_name}) has {top.layers} layers")
    return problems


__all__ = ["Claims", "Headers", "level_problems", "model_problems", "head_problems", "chain_problems"]
