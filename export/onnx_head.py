"""The draft head as ONNX, with an onnxruntime parity check.

The exported graph is the head's stateless pass (no KV cache): ``input_ids`` int64 [B, T] (tokens x_{t+1}) and
``features`` float32 [B, T, H] (features f_t) -> ``logits`` float32 [B, T, V] and ``hidden`` [B, T, H], causal within
the block, RoPE positions 0..T-1. For an EAGLE-3 head ``features`` is the fused feature g_t = fc(aux_t) (the head's
``fuse``, EAGLE-3.1's fc_norm included; ``fc.weight`` and ``fc_norm.*`` are in its model.safetensors) or the head's
own ``hidden`` of the step before (EAGLE-3.1: the normalised state), and the logits
are its draft vocabulary's scattered to target ids (-inf elsewhere), as ``Eagle3Head.forward`` returns them. The target's embedding and lm_head are part of the graph, so the file is
self-contained. Export uses ``torch.onnx.export(dynamo=True)`` with dynamic batch and sequence axes (the legacy
TorchScript exporter is not used). onnx / onnxruntime / onnxscript are imported inside the functions.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from polyspec.chain_spec import EAGLE3_TYPES
from polyspec.errors import PolyspecError

ONNX_FILE = "head.onnx"
INPUT_NAMES = ("input_ids", "features")
OUTPUT_NAMES = ("logits", "hidden")


class _StatelessHead(nn.Module):
    """The head's stateless pass with an explicit causal mask (built from the head's own modules), so that every
    T >= 1 takes one graph; :func:`onnx_parity` checks it against ``EagleHead.forward`` itself."""

    def __init__(self, head: nn.Module):
        super().__init__()
        self.head = head

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from polyspec.decode.model import rope_cos_sin

        hd = self.head
        b, t = input_ids.shape
        dtype = hd.layer.input_layernorm.weight.dtype
        emb = hd.embed_tokens(input_ids).to(dtype)  # [B, T, H]
        x = torch.cat((emb, features.to(dtype)), dim=-1)  # [B, T, 2H]
        eagle3 = getattr(hd, "head_type", "eagle") in EAGLE3_TYPES
        if not eagle3:  # EAGLE-1/2: fc first; an EAGLE-3 layer splits the pair itself
            x = hd.fc(x)  # [B, T, H]
        cos, sin = rope_cos_sin(hd.inv_freq, torch.arange(t, device=x.device), x.dtype)  # [T, D] each
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # [T, T]
        x = hd.layer(x, cos, sin, causal, None, 0, 0)  # [B, T, H]
        if not eagle3:
            return hd.lm_head(x).float(), x
        x = hd.state(x)  # what the head returns and feeds back (EAGLE-3.1: normalised)
        sub = hd.draft_logits(x).float()  # [B, T, Vd]: scattered to target ids, -inf elsewhere, as the head does
        full = torch.full((b, t, hd.args.vocab_size), float("-inf"), device=x.device)
        return full.index_copy(-1, hd.draft_ids, sub), x


def _require(module: str, extra: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise PolyspecError(f"ONNX export needs {module}: pip install {extra}") from None


def export_head_onnx(head: nn.Module, out_dir: Path, *, opset: int = 18, example_len: int = 5) -> Path:
    """Write ``out_dir/head.onnx`` (plus its external-data file when the exporter makes one); returns the .onnx path.

    The head must have no KV cache in use (a fresh :func:`~polyspec.decode.head.load_head`); it is exported in
    float32 on CPU. Files are written under a temporary name in ``out_dir`` and renamed into place.
    """
    _require("onnxscript", "onnxscript onnx")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if getattr(head, "_cache", None) is not None:
        raise PolyspecError("export_head_onnx: the head has a KV cache set up; export a freshly loaded head")
    wrapper = _StatelessHead(head).eval().to("cpu", torch.float32)
    h = head.args.hidden_size
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, head.args.vocab_size, (1, example_len), generator=gen)  # [1, T]
    feats = torch.randn(1, example_len, h, generator=gen)  # [1, T, H]
    batch, seq = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=1, max=65536)
    tmp = Path(tempfile.mkdtemp(prefix=".onnx-", dir=out_dir))
    try:
        with torch.no_grad():
            torch.onnx.export(wrapper, (ids, feats), str(tmp / ONNX_FILE), dynamo=True, opset_version=opset,
                              input_names=list(INPUT_NAMES), output_names=list(OUTPUT_NAMES),
                              dynamic_shapes={"input_ids": {0: batch, 1: seq}, "features": {0: batch, 1: seq}},
                              verbose=False)
        produced = sorted(p for p in tmp.iterdir() if p.is_file())
        if not any(p.name == ONNX_FILE for p in produced):
            raise PolyspecError(f"the ONNX exporter wrote no {ONNX_FILE} in {tmp}")
        for p in produced:  # external data first, the .onnx last: a present .onnx means a complete export
            if p.name != ONNX_FILE:
                os.replace(p, out_dir / p.name)
        os.replace(tmp / ONNX_FILE, out_dir / ONNX_FILE)
    except PolyspecError:
        raise
    except Exception as exc:
        raise PolyspecError(f"exporting the draft head to ONNX failed ({type(exc).__name__}: {exc})") from None
    finally:
        for p in tmp.glob("*"):
            p.unlink()
        tmp.rmdir()
    return out_dir / ONNX_FILE


def onnx_parity(head: nn.Module, onnx_path: Path, *, shapes: tuple[tuple[int, int], ...] = ((1, 1), (2, 7)),
                seed: int = 1) -> dict[str, Any]:
    """Run the ONNX file with onnxruntime (CPU) and the torch head on the same random inputs, for each (B, T) in
    ``shapes``; returns {"max_abs_diff", "max_abs_diff_logits", "max_abs_diff_hidden", "shapes", "onnxruntime"}."""
    ort = _require("onnxruntime", "onnxruntime")
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    gen = torch.Generator().manual_seed(seed)
    h, v = head.args.hidden_size, head.args.vocab_size
    dtype = next(head.parameters()).dtype
    diffs = {"logits": 0.0, "hidden": 0.0}
    for b, t in shapes:
        ids = torch.randint(0, v, (b, t), generator=gen)  # [B, T]
        feats = torch.randn(b, t, h, generator=gen)  # [B, T, H]
        got = sess.run(list(OUTPUT_NAMES), {"input_ids": ids.numpy(), "features": feats.numpy()})
        with torch.no_grad():
            ref = head(ids, feats.to(dtype))  # the head's own forward: [B, T, V], [B, T, H]
        for name, o, r in zip(OUTPUT_NAMES, got, ref, strict=True):
            o, r = torch.from_numpy(o), r.float()
            if tuple(o.shape) != tuple(r.shape):
                raise PolyspecError(f"ONNX head output {name} has shape {tuple(o.shape)}, torch {tuple(r.shape)}")
            finite = torch.isfinite(r)  # an EAGLE-3 head's -inf outside its draft vocabulary must match exactly
            if not torch.equal(finite, torch.isfinite(o)) or not torch.equal(o[~finite], r[~finite]):
                raise PolyspecError(f"ONNX head output {name}: its non-finite entries differ from the torch head's")
            diffs[name] = max(diffs[name], float((o[finite] - r[finite]).abs().max()) if finite.any() else 0.0)
    return {"max_abs_diff": max(diffs.values()), "max_abs_diff_logits": diffs["logits"],
            "max_abs_diff_hidden": diffs["hidden"], "shapes": [list(s) for s in shapes],
            "onnxruntime": getattr(ort, "__version__", None)}
