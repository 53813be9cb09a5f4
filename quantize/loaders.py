"""Which GPTQ loaders read an int4 folder, and the regrouping that lets all of them read SmolLM2's.

A GPTQ folder stores one ``group_size`` for every layer. Loaders other than polyspec's need K % group_size == 0:
vLLM allocates ``scales`` as K // group_size rows (a short last group does not fit) and GPTQModel's default CPU kernel
(ATen int4pack, what transformers uses) refuses the rest. SmolLM2-135M has K = 576 (hidden size, and 9 heads x 64),
which is not a multiple of 128. :func:`make_portable` stores such a folder with the largest group dividing every K
(64 for SmolLM2) with each scale and zero row repeated: the dequantised weights are identical bit for bit, so every
loader computes the same model, and polyspec's loader merges the repeated groups back.

Why not pad K to 640 instead: K = hidden_size is fixed by config.json, so padding means a 640-wide model (the
embedding, every norm and matrix widened with zeros). RMSNorm divides by the mean of x^2 over the hidden size, so the
extra zeros change every normalised activation unless eps and every norm weight are rescaled (by 576/640 and
sqrt(576/640)), which is exact in real arithmetic but not in floating point; o_proj's K (heads x head_dim) needs
zero heads too, which breaks the grouped-query head order unless heads are interleaved. It would cost 11-33 % more
work in the level whose cost ratio decides whether the chain pays, for a layout no loader needs once the groups
divide K. :func:`loader_support` states per loader, from its own shape checks, what it takes; vLLM checks the layers
it builds, q/k/v and gate/up merged (:func:`vllm_shapes`: N = 960 and 3072 for SmolLM2), and :func:`vllm_notes`
records those shapes and the rule per vLLM version in the folder's ``meta.polyspec_vllm``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# What vLLM's GPTQ kernels take (bits 4, sym, no act-order), from each kernel's ``can_implement`` read in
# vllm-project/vllm at commit 007d5005 (main, 2026) and 6eb28706 (2024): Marlin through
# utils/marlin_utils.py verify_marlin_supports_shape (N % GPTQ_MARLIN_MIN_THREAD_N = 64, K % GPTQ_MARLIN_MIN_THREAD_K
# = 128, K % group when group < K; the same constants at both commits, although the CUDA kernel itself compiles
# thread_k = 64 tiles: vLLM issue 6244), kernels/mixed_precision/machete.py (SM90 only, groups 64/128,
# machete_utils: K % 64, N % 128) and exllama.py (float16 activations, full K % group, N % 8).
VLLM_KERNELS = (
    ("Marlin", lambda k, n, g: k % 128 == 0 and n % 64 == 0 and k % g == 0, "any 16-bit dtype"),
    ("Machete", lambda k, n, g: g in (64, 128) and k % 64 == 0 and n % 128 == 0, "Hopper (SM90) only"),
    ("Exllama", lambda k, n, g: k % g == 0 and n % 8 == 0, "--dtype float16 only"),
)
# vLLM's Llama builds one QKVParallelLinear and one MergedColumnParallelLinear per layer, so its kernel checks see
# the merged N (q + k + v, gate + up), never a single projection's (llama.py: stacked_params_mapping).
VLLM_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
# The rule per vLLM version, recorded in the folder's meta (and so in the chain manifest's level entry).
VLLM_RULES = {
    "v0.6.2 and later (per-layer kernel choice since PR 7701; read at main 007d5005)":
        "per merged layer the first of Machete, Marlin, Exllama whose can_implement takes (K, N, group); none -> "
        "load error",
    "before v0.6.2 (gptq_marlin without a kernel choice; read at 6eb28706)":
        "gptq_marlin raises on a layer Marlin does not take; --quantization gptq (Exllama, float16 only) loads it",
}


def layer_shapes(folder: Path) -> dict[str, tuple[int, int]]:
    """{layer name: (K, N)} of every quantised layer in the folder's safetensors files."""
    from safetensors import safe_open

    shapes = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for key in f.keys():
                if key.endswith(".qweight"):
                    rows, n = f.get_slice(key).get_shape()
                    shapes[key[: -len(".qweight")]] = (rows * 8, n)  # int32 words of 8 nibbles along K
    return shapes


def vllm_shapes(shapes: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    """The layers vLLM builds from these: q/k/v and gate/up merged into one layer each (N summed, K shared)."""
    out: dict[str, tuple[int, int]] = {}
    for name, (k, n) in shapes.items():
        prefix, _, leaf = name.rpartition(".")
        merged = next((m for m, parts in VLLM_MERGED.items() if leaf in parts), None)
        if merged is None:
            out[name] = (k, n)
            continue
        key = f"{prefix}.{merged}" if prefix else merged
        k0, n0 = out.get(key, (k, 0))
        if k0 != k:
            raise ValueError(f"{name}: K = {k}, but the other parts of {key} have K = {k0}")
        out[key] = (k, n0 + n)
    return out


def loader_support(shapes: dict[str, tuple[int, int]], group_size: int) -> dict[str, str]:
    """Per loader: "yes", "yes: <condition>" or "no: <why>" for a folder with these layer shapes and group size."""
    ks = sorted({k for k, _ in shapes.values()})
    bad_k = [k for k in ks if k % group_size]
    out = {"polyspec": "yes (any K; a short last group runs on kernel groups that divide K)"}
    if bad_k:
        out["transformers+gptqmodel"] = (f"yes with GPTQConfig(bits=4, backend='gptq_torch') only: the default ATen "
                                         f"CPU kernel needs K % {group_size} == 0 (K = {bad_k})")
        out["vllm"] = (f"no: vLLM sizes scales as K // group_size rows, so K = {bad_k} (not multiples of "
                       f"{group_size}) do not load")
        return out
    out["transformers+gptqmodel"] = "yes"
    return out | {"vllm": _vllm_verdict(vllm_shapes(shapes), group_size)}


def _vllm_verdict(merged: dict[str, tuple[int, int]], group_size: int) -> str:
    """vLLM's verdict on its merged layers: Marlin everywhere, or which other kernel each remaining shape needs."""
    layer_kernels = []
    for k, n in sorted(set(merged.values())):
        fits = [(name, note) for name, ok, note in VLLM_KERNELS if ok(k, n, group_size)]
        if not fits:
            return f"no: no vLLM GPTQ kernel takes the merged layer K={k} N={n} with group {group_size}"
        layer_kernels.append((k, n, fits))
    if all(fits[0][0] == "Marlin" for *_, fits in layer_kernels):
        return "yes (Marlin on every merged layer)"
    shapes_text = ", ".join(f"K={k} N={n}: {' / '.join(f'{a} ({b})' for a, b in fits)}"
                            for k, n, fits in layer_kernels if fits[0][0] != "Marlin")
    return (f"yes: Marlin needs K % 128 == 0, N % 64 == 0 and K % group == 0, so these merged layers need another "
            f"kernel ({shapes_text}); not run here")


def vllm_notes(shapes: dict[str, tuple[int, int]], group_size: int) -> dict[str, Any]:
    """What the folder's meta records for vLLM: the merged shapes its checks see, per kernel whether each takes
    them, and the rule per vLLM version."""
    merged = sorted({(name.rpartition(".")[2], k, n) for name, (k, n) in vllm_shapes(shapes).items()})
    return {"group_size": group_size,
            "merged_layers": {f"{leaf} K={k} N={n}": [name for name, ok, _ in VLLM_KERNELS if ok(k, n, group_size)]
                              for leaf, k, n in merged},
            "rules": VLLM_RULES}


def make_portable(folder: Path, group_size: int) -> dict[str, Any]:
    """Rewrite the GPTQ folder (quantised with ``group_size``) for every loader: regroup when some K is not a
    multiple of it, add polyspec to ``meta.quantizer`` and the loader verdicts to ``meta``. Returns
    {"quantized_group_size", "stored_group_size", "loaders"}. Call it on a folder not yet in place (it writes
    files directly)."""
    from polyspec.decode.int4 import portable_group_size

    shapes = layer_shapes(folder)
    stored = portable_group_size({k for k, _ in shapes.values()}, group_size)
    if stored != group_size:
        _regroup_files(folder, group_size, stored)
    loaders = loader_support(shapes, stored)
    _update_configs(folder, stored, group_size, loaders, vllm_notes(shapes, stored))
    return {"quantized_group_size": group_size, "stored_group_size": stored, "loaders": loaders}


def _regroup_files(folder: Path, group_size: int, stored: int) -> None:
    """Rewrite every safetensors file of the folder with its GPTQ layers stored with groups of ``stored``."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from polyspec.decode.int4 import regroup_tensors

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors = regroup_tensors({key: f.get_tensor(key) for key in f.keys()}, group_size, stored)
            metadata = f.metadata()
        tmp = path.with_name(path.name + ".regroup")
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)


def _update_configs(folder: Path, stored: int, group_size: int, loaders: dict[str, str],
                    vllm: dict[str, Any]) -> None:
    """group_size -> ``stored`` and polyspec's meta in config.json's quantization_config and quantize_config.json."""
    from polyspec import __version__

    for name in ("config.json", "quantize_config.json"):
        p = Path(folder) / name
        if not p.is_file():
            continue
        cfg = json.loads(p.read_text(encoding="utf-8"))
        qc = cfg["quantization_config"] if name == "config.json" else cfg
        qc["group_size"] = stored
        qc.setdefault("lm_head", False)
        qc.setdefault("checkpoint_format", qc.get("format") or "gptq")
        meta = qc.setdefault("meta", {})
        quantizer = meta.get("quantizer") or []
        quantizer = [quantizer] if isinstance(quantizer, str) else list(quantizer)
        tag = f"polyspec:{__version__}"
        meta["quantizer"] = quantizer + ([tag] if tag not in quantizer else [])
        if stored != group_size:
            meta["polyspec_quantized_group_size"] = group_size
        meta["polyspec_loaders"] = loaders
        meta["polyspec_vllm"] = vllm
        p.write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
