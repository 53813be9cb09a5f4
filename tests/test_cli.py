"""The console entry point: --help for every verb, fast startup, validate's exit codes."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from polyspec.cli import build_parser, main

REPO = Path(__file__).resolve().parent.parent


def _verbs():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "verb")
    return sorted(sub.choices)


@pytest.mark.parametrize("verb", _verbs())
def test_help_for_every_verb(verb, capsys):
    with pytest.raises(SystemExit) as ei:
        main([verb, "--help"])
    assert ei.value.code == 0
    assert "usage: polyspec" in capsys.readouterr().out


def test_top_level_help_is_fast_and_imports_nothing_heavy():
    code = (
        "import sys, time; t=time.perf_counter(); from polyspec.cli import build_parser; build_parser();"
        "heavy=[m for m in ('torch','transformers','lightning','mlflow','datasets','gptqmodel','deepspeed')"
        " if m in sys.modules]; print(heavy); print(time.perf_counter()-t)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "[]"
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "polyspec", "--help"], capture_output=True, check=True)
    assert time.perf_counter() - t0 < 2.0


@pytest.mark.parametrize("module, verb", [("polyspec.train", "train"), ("polyspec.quantize", "quantize"),
                                          ("polyspec.bench", "bench")])
def test_python_m_entries_are_the_cli_verbs(module, verb):
    """``python -m polyspec.<stage>`` is a shim onto the one parser, not a parser of its own."""
    out = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, check=True).stdout
    assert out.startswith(f"usage: polyspec {verb} ")


def test_validate_prints_resolved_yaml(capsys):
    assert main(["validate", str(REPO / "recipes" / "smollm2_demo.yaml"), "train.lr=0.001"]) == 0
    out = capsys.readouterr().out
    assert "workdir: runs/smollm2_demo" in out and "lr: 0.001" in out and "group_size: 128" in out


def test_validate_bad_key_exits_2(capsys, tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("workdir: w\nquantize:\n  bitz: 4\n")
    assert main(["validate", str(p)]) == 2
    err = capsys.readouterr().err
    assert "quantize.bitz" in err and str(p) in err and "group_size" in err
