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


def _refused(capsys, argv: list[str]) -> str:
    """``polyspec ARGV`` exits 2 with one error line set and no traceback; returns stderr."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and f"polyspec {argv[0]}: error: " in captured.err
    return captured.err


@pytest.mark.parametrize("text", ["", "# only a comment\n", "{}\n"])
def test_an_empty_recipe_is_refused_by_validate_and_run(capsys, tmp_path, monkeypatch, text):
    monkeypatch.chdir(tmp_path)
    p = tmp_path / "r.yaml"
    p.write_text(text)
    for verb in ("validate", "run"):
        err = _refused(capsys, [verb, str(p)])
        assert "the recipe is empty" in err and str(p) in err
    assert list(tmp_path.iterdir()) == [p], "run must start no work from an empty recipe"


def test_a_duplicate_key_is_refused_with_its_line(capsys, tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("workdir: w\ntrain:\n  lr: 0.1\n  epochs: 2\n  lr: 0.2\n")
    err = _refused(capsys, ["validate", str(p)])
    assert "line 5" in err and "'lr'" in err and "line 3" in err and str(p) in err
    p.write_text("workdir: a\ntrain: {lr: 0.1}\nworkdir: b\n")
    assert "key 'workdir'" in _refused(capsys, ["run", str(p)])


def test_missing_local_sources_fail_validation(capsys, tmp_path):
    from conftest import make_tiny_llama

    p = tmp_path / "r.yaml"
    sample = REPO / "tests" / "assets" / "sharegpt_sample.json"
    p.write_text(f"workdir: {tmp_path / 'w'}\ntarget: {{source: {tmp_path / 'no_model'}}}\n"
                 f"data: {{source: {sample}}}\n")
    err = _refused(capsys, ["validate", str(p)])
    assert "target.source" in err and str(tmp_path / "no_model") in err and "does not exist" in err
    model = make_tiny_llama(tmp_path / "model")
    err = _refused(capsys, ["validate", str(p), f"target.source={model}", f"data.source={tmp_path / 'none.json'}"])
    assert "data.source" in err and str(tmp_path / "none.json") in err and "does not exist" in err
    # hub and packaged sources are checked for their form only (no network here)
    assert main(["validate", str(p), f"target.source={model}", "data.source=hf:someone/some-data"]) == 0
    assert main(["validate", str(p), "target.source=hf:org/name"]) == 0
    capsys.readouterr()
    assert "hf:ORG/NAME" in _refused(capsys, ["validate", str(p), "target.source=hf:noslash"])
