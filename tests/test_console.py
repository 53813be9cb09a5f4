"""The quiet console: third-party output goes to a log file in the workdir; polyspec's own lines stay on the
terminal (checked at the file-descriptor level with capfd, where native code and subprocesses write too)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import warnings
from pathlib import Path


def _noise() -> None:
    """What libraries do during a stage: a warning, a log record, a print, a tqdm-style bar, native writes."""
    # what warnings.showwarning writes (pytest records warnings itself, so the write is spelled out)
    sys.stderr.write(warnings.formatwarning("pytree-style deprecation from a library", DeprecationWarning, __file__, 1))
    logging.lastResort.handle(logging.makeLogRecord({"msg": "Failed to load a library .so", "levelno": 30}))
    lib = logging.getLogger("polyspec-test-lib")  # a library that binds its own handler when imported
    lib.propagate = False
    lib.addHandler(logging.StreamHandler())
    lib.warning("lightning: GPU available: False")
    print("GPTQModel row 3/30 progress")
    sys.stderr.write("\rWriting model shards: 100%|##########|\n")
    os.write(2, b"native write to fd 2\n")
    subprocess.run([sys.executable, "-c", "print('ninja: building extension')"], check=True)


def test_quiet_sends_third_party_output_to_the_log_and_says_its_name(tmp_path, capfd):
    from polyspec.console import log_path, quiet, say

    with quiet(tmp_path / "work", "run") as path:
        assert log_path() == path and path.parent == tmp_path / "work" / "logs"
        say("train    draft head ready")
        _noise()
        with quiet(tmp_path / "elsewhere", "inner") as inner:  # a stage inside `polyspec run`: the same log
            assert inner == path
    assert log_path() is None
    out, err = capfd.readouterr()
    assert "train    draft head ready" in err
    for noise in ("pytree-style", "Failed to load", "GPU available", "GPTQModel row", "Writing model shards",
                  "native write", "ninja"):
        assert noise not in out + err
        assert noise in path.read_text()
    assert f"third-party output (logs, warnings, their progress bars): {path}" in err  # named at the end
    print("after")  # the descriptors are back
    lib = logging.getLogger("polyspec-test-lib")
    lib.warning("a library's handler made inside the block")  # writes to descriptor 2 again, not to a closed file
    lib.handlers.clear()
    out, err = capfd.readouterr()
    assert out == "after\n" and "handler made inside the block" in err


def test_a_quiet_block_without_third_party_output_leaves_no_log(tmp_path, capfd):
    from polyspec.console import quiet, say

    with quiet(tmp_path, "profile") as path:
        say("profile: nothing else printed")
    assert not path.exists() and not any((tmp_path / "logs").iterdir())
    assert "third-party" not in capfd.readouterr().err


def test_polyspec_console_all_turns_it_off(tmp_path, capfd, monkeypatch):
    from polyspec.console import quiet

    monkeypatch.setenv("POLYSPEC_CONSOLE", "all")
    with quiet(tmp_path, "run") as path:
        print("library line")
    assert path is None and "library line" in capfd.readouterr().out


def test_a_stage_command_keeps_library_output_off_the_terminal(tmp_path, capfd, monkeypatch):
    """`polyspec quantize RECIPE`: the stage's third-party noise lands in <workdir>/logs, the result on stdout."""
    import polyspec.pipeline as pipeline
    from polyspec.cli import main

    def stage(recipe, tracker=None):
        _noise()
        return Path(recipe.workdir) / "quantize" / "k" / "model"

    monkeypatch.setattr(pipeline, "run_quantize", stage)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"workdir: {tmp_path / 'work'}\ntracking:\n  enabled: false\n", encoding="utf-8")
    assert main(["quantize", str(recipe)]) == 0
    out, err = capfd.readouterr()
    assert "intermediate model:" in out and "GPTQModel row" not in out + err and "native write" not in err
    logs = list((tmp_path / "work" / "logs").glob("quantize-*.log"))
    assert len(logs) == 1 and "GPTQModel row" in logs[0].read_text() and str(logs[0]) in err


def test_activity_prints_one_line_when_not_a_terminal(tmp_path, capfd):
    from polyspec.console import activity, quiet

    with quiet(tmp_path, "quantize"), activity("quantize: GPTQ int4 g128"):
        print("GPTQModel per-row progress")
    err = capfd.readouterr().err
    assert "quantize: GPTQ int4 g128 ..." in err and "per-row" not in err


def test_a_handler_made_under_a_live_bar_writes_to_the_log(tmp_path, capfd, monkeypatch):
    """On a terminal the bar is rich's; a library that makes a logging handler while it shows (tokenicer's
    basicConfig when GPTQModel is imported) must still write to the log, during the bar and after it."""
    import polyspec.console as console

    with console.quiet(tmp_path, "quantize") as path:
        terminal = console.stream()
        monkeypatch.setattr(terminal, "isatty", lambda: True)  # the live bar, as on a terminal
        before = sys.stderr
        with console.activity("quantize: GPTQ int4 g128"):
            assert sys.stderr is before  # not rich's proxy of the terminal
            lib = logging.getLogger("polyspec-test-basicconfig")
            lib.propagate = False
            lib.addHandler(logging.StreamHandler())  # bound to sys.stderr as it is now
            lib.warning("tokenicer-style record during the bar")
        lib.warning("tokenicer-style record after the bar")
        lib.handlers.clear()
    err = capfd.readouterr().err
    assert "tokenicer-style" not in err
    assert path.read_text().count("tokenicer-style record") == 2
