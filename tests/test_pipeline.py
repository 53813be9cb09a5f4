"""`polyspec run` end to end on a tiny recipe: every stage runs, the chain validates and generates, a rerun skips
finished stages, and a stage killed midway leaves no half-written artifact and is redone."""

import json
import re
import time
from pathlib import Path

import pytest
from conftest import ASSETS, make_tiny_llama

from polyspec.cli import main

pytest.importorskip("gptqmodel", reason="the [quant] extra (gptqmodel) is needed for the quantize stage")

SAMPLE = ASSETS / "sharegpt_sample.json"


def _recipe(tmp_path: Path, target: Path) -> Path:
    text = f"""# Run: polyspec run {tmp_path}/r.yaml
workdir: {tmp_path / "work"}
target: {{source: {target}, device: cpu}}
data: {{source: {SAMPLE}, max_length: 96, heldout_fraction: 0.25}}
tracking: {{enabled: true}}
train: {{epochs: 1, max_steps: 4, batch_size: 2, lr: 0.002, warmup_steps: 1, checkpoint_every: 2}}
quantize: {{calibration_samples: 4, calibration_length: 32, devices: cpu}}
profile: {{prompts: 2, max_new_tokens: 8, kv_length: 16, repeats: 1, draft_k_grid: [2], mu_grid: [4],
          grid_prompts: 1, lookup_grid: [3]}}
decode: {{draft: {{k: 2}}, mu: [4], max_new_tokens: 8}}
"""
    p = tmp_path / "r.yaml"
    p.write_text(text)
    return p


@pytest.mark.slow  # heavy (the fast tier stays under 6 minutes: README)
def test_run_end_to_end_rerun_and_interrupted_stage(tmp_path, monkeypatch, capfd):
    capsys = capfd  # polyspec's own lines go to the terminal's descriptors (polyspec.console), not sys.stdout
    target = make_tiny_llama(tmp_path / "target", seed=4)
    recipe = _recipe(tmp_path, target)
    capsys.readouterr()  # the fixture's own output
    assert main(["run", str(recipe)]) == 0
    out, err = capsys.readouterr()
    # piped (capfd's descriptors are files): polyspec's own lines, no bar redrawn in place into one endless line
    lines = (out + err).splitlines()
    assert len(lines) < 150 and max(map(len, lines)) < 400, (len(lines), max(map(len, lines)))
    assert re.search(r"^train: step \d+/\d+ \(100%\), loss ", err, re.M) and "\r" not in out + err, err
    chain = tmp_path / "work" / "chain"
    assert (chain / "manifest.json").is_file()
    assert main(["validate-chain", str(chain)]) == 0
    manifest = json.loads((chain / "manifest.json").read_text())
    assert [lv["kind"] for lv in manifest["levels"]] == ["target", "int4", "head"]
    assert manifest["measurements"], "profile measurements belong in the manifest"
    assert any(f.endswith(".onnx") for f in manifest["levels"][2]["files"])
    assert "verdicts" in out and "assistant:" in out
    assert "export: MLflow model models:/" in err  # the chain as an MLflow model (tests/test_mlflow_model.py)
    (log,) = (tmp_path / "work" / "logs").glob("run-*.log")  # third-party output, named at the end
    assert f"third-party output (logs, warnings, their progress bars): {log}" in err
    assert "Creating initial MLflow database tables" in log.read_text() and "MLflow database" not in out + err
    assert (tmp_path / "work" / "mlflow.db").is_file()
    assert (tmp_path / "work" / "recipe.resolved.yaml").is_file()

    # a rerun with the same inputs skips every stage: much faster, same chain
    t0 = time.perf_counter()
    before = (chain / "manifest.json").read_text()
    assert main(["run", str(recipe)]) == 0
    capsys.readouterr()
    assert json.loads((chain / "manifest.json").read_text())["levels"] == json.loads(before)["levels"]

    # a truncated head is named and trained again on the next run (it used to be reused, and the profile crashed)
    (head,) = [p for p in (tmp_path / "work" / "head").iterdir() if not p.name.startswith(".")]
    weights = head / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:100])
    assert main(["run", str(recipe)]) == 0
    assert "is damaged" in capsys.readouterr().err
    assert weights.stat().st_size == len(whole)
    assert main(["validate-chain", str(chain)]) == 0

    # a stage killed midway (new train settings -> new head) leaves no half-written folder; the next run redoes it
    import polyspec.decode.head as head_mod

    heads_before = set((tmp_path / "work" / "head").iterdir())

    def killed(*a, **k):  # the head is being written when the process is killed
        raise KeyboardInterrupt

    monkeypatch.setattr(head_mod, "save_head", killed)
    assert main(["run", str(recipe), "train.max_steps=6"]) == 130
    new = set((tmp_path / "work" / "head").iterdir()) - heads_before
    assert all(p.name.startswith(".") or not (p / "model.safetensors").exists() for p in new), new
    monkeypatch.undo()
    assert main(["run", str(recipe), "train.max_steps=6"]) == 0
    capsys.readouterr()
    assert main(["validate-chain", str(chain)]) == 0
    print(f"rerun took {time.perf_counter() - t0:.1f} s")
