"""Exporting a tiny random chain: the folder validates, carries the measurements, the ONNX head matches torch, an
interrupted export leaves nothing half-written, tampering is detected, and the decoder loads the result."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from polyspec.decode import cpu_kernels as ck
from polyspec.errors import PolyspecError
from polyspec.manifest import read_manifest, validate_chain

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def parts(tiny_parts):
    return tiny_parts


@pytest.fixture(scope="module")
def profile(parts, tmp_path_factory):
    from polyspec.export.profile import ProfileSettings
    from polyspec.export.stage import profile_folders

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (12,), generator=g).tolist()]
    s = ProfileSettings(max_new_tokens=8, kv_length=16, warmup=0, repeats=2, draft_ks=(2,), mus=(4,))
    return profile_folders(parts, tmp_path_factory.mktemp("prof") / "p", s, device="cpu", prompt_ids=prompts,
                           threads=1, say=lambda _m: None)


@pytest.fixture(scope="module")
def chain(parts, profile, tmp_path_factory):
    from polyspec.chain_spec import DecodeSpec
    from polyspec.export.package import export_profiled

    out = tmp_path_factory.mktemp("export") / "chain"
    return export_profiled(out, parts, profile, DecodeSpec(max_new_tokens=16), onnx=True)


def test_exported_chain_validates_and_describes_itself(chain, profile):
    from polyspec.export.report import summary_L, verdict_json

    m = validate_chain(chain)
    assert [lv.kind for lv in m.levels] == ["target", "int4", "head"]
    assert m.levels[1].quantization["bits"] == 4 and m.levels[1].quantization["group_size"] == 128
    head = m.levels[2]
    assert {"head.onnx", "model.safetensors", "config.json"} <= set(head.files)
    assert all(len(h) == 64 for lv in m.levels for h in lv.files.values())
    meas = m.measurements
    assert meas["schema"] == "polyspec.measurements/1"
    assert set(meas["T"]) == {"target", "intermediate", "draft"} and meas["T"]["draft"][0]["median_s"] > 0
    assert meas["L"] == summary_L(profile) and meas["verdict"] == json.loads(json.dumps(verdict_json(profile.insertions[0])))
    assert len(meas["insertions"]) == 1 and meas["insertions"][0]["level"] == "intermediate"
    assert meas["candidates"] == meas["insertions"][0]["candidates"] and meas["candidates"]
    assert set(meas["acceptance_hist"]["chain"]) == {"target", "intermediate"}
    assert {"wall", "steady", "vs_ar"} <= set(meas["speedup"])
    assert meas["speedup"]["wall"]["configs"]["chain"]["predicted"] > 0
    dec = profile.decision
    assert (m.decode.mode, m.decode.draft.model_dump(), m.decode.mu) == (dec.mode, dec.draft, dec.mu)
    assert m.decode.max_new_tokens == 16  # the other decode defaults come from the recipe
    assert m.schema_version == 2 and m.polyspec_version
    assert {"software", "hardware", "git_sha", "packages"} <= set(m.stamps)
    assert "torch" in m.stamps["packages"]
    # the CPU kernels' build the profile timed (row kernels and prefetch hint are per-CPU choices)
    assert m.stamps["profile"]["cpu_kernels"].startswith(("on (", "off (", "unavailable ("))
    if ck.available():
        assert f"prefetch locality {ck.prefetch_locality()}" in m.stamps["profile"]["cpu_kernels"]
    # only the chain folder is left next to it: no temporary or staging folders
    assert [p.name for p in chain.parent.iterdir()] == ["chain"]


def test_onnx_head_matches_torch(chain):
    import onnxruntime as ort

    from polyspec.decode.head import load_head
    from polyspec.decode.model import Transformer

    m = read_manifest(chain)
    assert m.measurements["onnx"]["max_abs_diff"] < 1e-4
    head_dir = chain / m.levels[2].path
    target = Transformer.from_pretrained(chain / m.levels[0].path)
    head = load_head(head_dir, target).eval()
    sess = ort.InferenceSession(str(head_dir / "head.onnx"), providers=["CPUExecutionProvider"])
    g = torch.Generator().manual_seed(9)
    for b, t in ((1, 1), (3, 5)):  # dynamic batch and sequence axes, T = 1 included
        ids = torch.randint(0, 512, (b, t), generator=g)
        feats = torch.randn(b, t, 128, generator=g)
        logits, hidden = sess.run(["logits", "hidden"], {"input_ids": ids.numpy(), "features": feats.numpy()})
        with torch.no_grad():
            ref_logits, ref_hidden = head(ids, feats)
        assert float((torch.from_numpy(logits) - ref_logits).abs().max()) < 1e-4
        assert float((torch.from_numpy(hidden) - ref_hidden).abs().max()) < 1e-4


def test_decoder_loads_and_runs_the_exported_chain(chain):
    from polyspec.decode.generate import generate_text, load_chain

    loaded = load_chain(chain, device="cpu")
    m = read_manifest(chain)
    assert loaded.decode == m.decode
    outs = {mode: generate_text(loaded, "hello there", mode=mode, max_new_tokens=10)["token_ids"]
            for mode in ("ar", "chain")}
    assert outs["chain"] == outs["ar"] and len(outs["ar"]) == 10


@pytest.mark.parametrize("exc", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_interrupted_export_leaves_no_half_written_folder(parts, profile, tmp_path, monkeypatch, exc):
    import polyspec.manifest as manifest
    from polyspec.chain_spec import DecodeSpec
    from polyspec.export.package import export_profiled

    real = manifest.write_manifest

    def write_then_die(chain_dir, m):  # the levels and a manifest are on disk when the "kill" arrives
        real(chain_dir, m)
        if m.measurements:
            raise exc

    monkeypatch.setattr(manifest, "write_manifest", write_then_die)
    out = tmp_path / "chain"
    with pytest.raises(type(exc)):
        export_profiled(out, parts, profile, DecodeSpec(), onnx=False)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temporary folder left either

    # an existing chain survives a failed re-export untouched
    monkeypatch.setattr(manifest, "write_manifest", real)
    export_profiled(out, parts, profile, DecodeSpec(), onnx=False)
    before = read_manifest(out).model_dump()
    monkeypatch.setattr(manifest, "write_manifest", write_then_die)
    with pytest.raises(type(exc)):
        export_profiled(out, parts, profile, DecodeSpec(), onnx=False)
    assert validate_chain(out).model_dump() == before
    assert [p.name for p in tmp_path.iterdir()] == ["chain"]


_SLOW_EXPORT = """
import json, shutil, sys, time
from pathlib import Path
copy = shutil.copyfile
def slow(src, dst, **kw):
    out = copy(src, dst, **kw)
    Path(sys.argv[3]).touch()  # the test kills this process once a file of the new chain is on disk
    time.sleep(60)
    return out
shutil.copyfile = slow
from polyspec.chain_spec import DecodeSpec
from polyspec.export.package import export_profiled
from polyspec.export.report import read_profile
parts = {k: Path(v) for k, v in json.loads(sys.argv[2]).items()}
export_profiled(Path(sys.argv[1]), parts, read_profile(Path(sys.argv[4])), DecodeSpec(), onnx=False)
"""


def test_export_killed_with_sigkill_then_rerun(parts, profile, tmp_path):
    """kill -9 of an export midway (as of `polyspec run` during its export stage): the old chain is whole, the dead
    writer's temporary folder is the only leftover, and the rerun removes it and writes a chain that validates."""
    import signal
    import subprocess
    import sys
    import time

    from polyspec.chain_spec import DecodeSpec
    from polyspec.export.package import export_profiled

    out = export_profiled(tmp_path / "chain", parts, profile, DecodeSpec(), onnx=False)
    before = validate_chain(out).model_dump()
    started = tmp_path / "started"
    argv = [str(out), json.dumps({k: str(v) for k, v in parts.items()}), str(started), str(profile.path)]
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_EXPORT, *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the export never started copying"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert validate_chain(out).model_dump() == before
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != "started")
    assert len(left) == 2 and left[0].startswith(f".chain.tmp-{proc.pid}@") and left[1] == "chain"
    export_profiled(out, parts, profile, DecodeSpec(), onnx=False)
    assert validate_chain(out).levels == read_manifest(out).levels
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chain", "started"]


def test_export_onto_a_full_file_system_is_one_error_and_the_old_chain_stays(parts, profile, tmp_path):
    """A real tmpfs of 1.5 chains (root only; skipped elsewhere, where tests/test_hostile.py's emulated ENOSPC still
    runs): the first export fits, the second does not: one error (exit 1), the old chain intact, nothing
    half-written."""
    import subprocess

    from polyspec.chain_spec import DecodeSpec
    from polyspec.export.package import export_profiled

    probe = export_profiled(tmp_path / "probe", parts, profile, DecodeSpec(), onnx=False)
    size_kb = sum(f.stat().st_size for f in probe.rglob("*") if f.is_file()) * 3 // 2 // 1024 + 64
    small = tmp_path / "small"
    small.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(small)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.decode(errors='replace').strip()})")
    try:
        out = export_profiled(small / "chain", parts, profile, DecodeSpec(), onnx=False)
        before = validate_chain(out).model_dump()
        with pytest.raises(PolyspecError, match="no space left on the device") as exc:
            export_profiled(out, parts, profile, DecodeSpec(), onnx=False)
        assert exc.value.exit_code == 1 and "the old one is intact" in str(exc.value)
        assert validate_chain(out).model_dump() == before
        assert sorted(p.name for p in small.iterdir()) == ["chain"]
    finally:
        subprocess.run(["umount", "-l", str(small)], check=False)


def test_tampering_and_extra_files_are_detected(chain, tmp_path):
    bad = tmp_path / "chain"
    shutil.copytree(chain, bad)
    onnx = bad / "levels" / "draft" / "head.onnx"
    data = bytearray(onnx.read_bytes())
    data[len(data) // 2] ^= 0xFF
    onnx.write_bytes(bytes(data))
    with pytest.raises(PolyspecError, match="head.onnx") as err:
        validate_chain(bad)
    assert err.value.exit_code != 0
    shutil.rmtree(bad)
    shutil.copytree(chain, bad)
    (bad / "levels" / "target" / "notes.txt").write_text("x")
    with pytest.raises(PolyspecError, match="notes.txt"):
        validate_chain(bad)


def test_export_stage_logs_to_the_tracker(parts, profile, tmp_path):
    from polyspec.config import validate_tree
    from polyspec.pipeline import run_export

    recipe = validate_tree({"workdir": str(tmp_path / "w"), "tracking": {"enabled": False},
                            "export": {"out": str(tmp_path / "out" / "chain"), "onnx": False},
                            "decode": {"max_new_tokens": 32}}, "test")
    calls = []

    class Tracker:
        def log_metrics(self, m, step=None):
            calls.append(("metrics", m))

        def set_tags(self, tags):
            calls.append(("tags", tags))

        def log_artifact(self, path, artifact_path=None):
            calls.append(("artifact", Path(path), artifact_path))

    out = run_export(recipe, Tracker(), parts=parts, measured=profile, say=lambda _m: None)
    assert out == tmp_path / "out" / "chain"
    m = validate_chain(out)
    assert m.measurements["onnx"] is None and "head.onnx" not in m.levels[2].files
    artifacts = [c[1] for c in calls if c[0] == "artifact"]
    assert out / "manifest.json" in artifacts and out / m.levels[2].path in artifacts


def test_export_stage_logs_the_chain_as_an_mlflow_model(parts, profile, tmp_path, monkeypatch):
    """With tracking on, the export stage logs the chain folder as a pyfunc model, registered as
    tracking.register_as (the model itself: tests/test_mlflow_model.py)."""
    from polyspec.config import validate_tree
    from polyspec.export import mlflow_model
    from polyspec.pipeline import run_export

    recipe = validate_tree({"workdir": str(tmp_path / "w"), "tracking": {"register_as": "demo-chain"},
                            "export": {"out": str(tmp_path / "chain"), "onnx": False}}, "test")
    logged = []
    monkeypatch.setattr(mlflow_model, "log_chain_model",
                        lambda tracker, chain, register_as=None: logged.append((chain, register_as)) or "models:/m")

    class Tracker:
        enabled = True

        def __getattr__(self, name):
            return lambda *a, **k: None

    said = []
    out = run_export(recipe, Tracker(), parts=parts, measured=profile, say=said.append)
    assert logged == [(out, "demo-chain")]
    assert any("MLflow model models:/m, registered as 'demo-chain'" in s for s in said)
    off = recipe.model_copy(update={"tracking": recipe.tracking.model_copy(update={"log_model": False})})
    run_export(off, Tracker(), parts=parts, measured=profile, say=said.append)
    assert len(logged) == 1  # tracking.log_model: false


def test_lossless_line_says_what_a_failed_greedy_check_means():
    from polyspec.export.report import _lossless_line

    assert _lossless_line(True, "cpu", "bfloat16").endswith(": True")
    assert "expected in bfloat16 on CUDA" in _lossless_line(False, "cuda", "bfloat16")
    assert "expected in float16 on CUDA" in _lossless_line(False, "cuda:1", "float16")
    for device, dtype in (("cuda", "float32"), ("cpu", "bfloat16")):
        assert "not expected" in _lossless_line(False, device, dtype)


def test_a_head_stays_the_draft_level_whatever_the_decision_drafts_with(parts, tmp_path):
    """export_chain on level folders, a DecodeSpec and a measurements dict: under prompt lookup drafting a bottom
    head is still the draft level (a head never verifies) and gets its ONNX file; a model level below the target
    becomes a verifier (no draft level) when prompt lookup drafts alone."""
    from polyspec.chain_spec import DecodeSpec, DraftSpec
    from polyspec.export.package import export_chain

    lookup = DecodeSpec(mode="chain", draft=DraftSpec(source="lookup", lookup=4))
    levels = [parts["target"], parts["int4"], parts["head"]]
    m = validate_chain(export_chain(tmp_path / "a", levels, lookup, {"note": 1}, onnx=True))
    assert [(lv.name, lv.kind) for lv in m.levels] == [("target", "target"), ("intermediate", "int4"),
                                                        ("draft", "head")]
    assert "head.onnx" in m.levels[2].files and m.measurements["note"] == 1 and m.decode == lookup
    m = validate_chain(export_chain(tmp_path / "b", levels[:2], lookup, {}, onnx=False))
    assert [(lv.name, lv.kind) for lv in m.levels] == [("target", "target"), ("intermediate", "int4")]
