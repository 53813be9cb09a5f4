"""lab/gpu/probe.py: versions, carried wheels' requirements, SDPA backends and the op split of one decode step
(the tiny shape on the CPU here; docs/GPU.md runs it on the GPU)."""

from __future__ import annotations

import json

import pytest
from conftest import lab_module

gpu_probe = lab_module("gpu/probe.py")
main = gpu_probe.main

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tiny_probe_counts_the_ops_of_one_decode_step(tmp_path, capsys):
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "pydantic-2.0-py3-none-any.whl").write_bytes(b"")  # only the file name is read
    (wheels / "surely_not_installed_pkg-1.0-py3-none-any.whl").write_bytes(b"")
    out = tmp_path / "probe.json"
    assert main(["--tiny", "--wheels", str(wheels), "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["shape"] == "tiny" and r["device"] == "cpu" and r["versions"]["python"]
    assert r["carried_wheels"] == {"pydantic": [], "surely_not_installed_pkg": ["not installed"]}
    for w in ("1", "5"):
        row = r["sdpa"][w]
        assert isinstance(row["default"], float) and isinstance(row["math"], float)  # math takes any input
        assert set(row) >= {"default", "math", "flash_attention", "efficient_attention", "cudnn_attention"}
    d = r["decode_step"]
    assert d["unit"] == "cpu leaf ops" and d["layers"] == 2
    assert d["per_step"] == pytest.approx(d["per_layer"] * d["layers"] + d["outside_layers"])
    assert d["per_layer"] > 0 and d["outside_layers"] > 0
    fams = d["families"]
    assert fams["attention"]["count"] == d["layers"]  # one attention per layer
    assert fams["matmul"]["count"] >= d["layers"] + 1  # each layer's projections and the lm_head
    assert sum(f["count"] for f in fams.values()) == d["per_step"]
    assert d["top"] and d["top"][0]["us"] >= d["top"][-1]["us"]
    text = capsys.readouterr().out
    assert "one eager decode step of tiny" in text and "per layer" in text and "carried pydantic: requirements met" in text


def test_kernel_families_by_name():
    assert gpu_probe.family("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "matmul"
    assert gpu_probe.family("void gemv2T_kernel_val<int, int, __nv_bfloat16>") == "matmul"
    assert gpu_probe.family("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"
    assert gpu_probe.family("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"
    assert gpu_probe.family("void at::native::vectorized_elementwise_kernel<4, at::native::MulFunctor>") == "other"
    assert gpu_probe.family("aten::mm") == "matmul" and gpu_probe.family("aten::add") == "other"


def test_probe_bad_input(tmp_path, capsys):
    assert main(["--tiny", "--wheels", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert "--wheels" in err and "not a folder" in err
    assert main(["--tiny", "--cache-len", "2"]) == 2
    assert "--cache-len must be >= 8" in capsys.readouterr().err


def test_carried_wheel_requirements_name_what_is_unmet(tmp_path, monkeypatch):
    """A carried wheel installed without its dependencies: each requirement the machine does not meet is named."""
    info = tmp_path / "site" / "carried_pkg-1.0.dist-info"
    info.mkdir(parents=True)
    info.joinpath("METADATA").write_text(
        "Metadata-Version: 2.1\nName: carried-pkg\nVersion: 1.0\nRequires-Dist: pydantic>=999\n"
        "Requires-Dist: surely-missing-zzz\nRequires-Dist: pytest\nRequires-Dist: absent-extra; extra == \"x\"\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    wheels = tmp_path / "whl"
    wheels.mkdir()
    (wheels / "carried_pkg-1.0-py3-none-any.whl").write_bytes(b"")
    unmet = gpu_probe.wheel_requirements(wheels)["carried_pkg"]
    assert len(unmet) == 2
    assert unmet[0].startswith("pydantic>=999 (have ") and unmet[1] == "surely-missing-zzz (missing)"
