"""The GPU check (lab/gpu/check.sh, docs/GPU.md) on the CPU: every step leaves its JSON with the keys the docs name,
also when the call's budget is spent or a step runs past its limit; the two calls fit the device tool's limits; the
7B projection's replay really drives the decoder with the recorded acceptance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, lab_module

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CHECK = {"step", "rc", "seconds", "limit", "timed_out"}
# the keys docs/GPU.md names for each step's JSON (besides "check")
KEYS = {
    1: {"env": {"versions", "stamp"}, "a_tests": {"counts", "tests", "failed", "skipped", "slowest"},
        "b_kernel_ab": {"results", "not_run", "shapes", "rows", "layers", "device"},
        "c_shape_bench": {"ar", "roofline", "forward_times", "int4_ratio", "stamp"},
        "d_projection": {"T_ms", "paper_projection", "record", "replay", "build", "draft_vocab"},
        "i_int4_sweep": {"results", "shapes", "rows"}},
    2: {"e_assemble": {"levels", "decode", "int4", "target"}, "f_bench_fp32": {"overall", "mismatches", "stamp"},
        "g_bench_bf16": {"overall", "mismatches", "stamp"},
        "h_tests": {"counts", "tests", "failed", "skipped", "slowest"}},
}


def run_call(call: int, out: Path, **env: str) -> subprocess.CompletedProcess:
    venv_bin = str(Path(sys.executable).parent)
    full = dict(os.environ, GPU_CHECK_DRY="1", GPU_CHECK_PYTHON=sys.executable, OUT=str(out),
                PATH=f"{venv_bin}:{os.environ.get('PATH', '')}", OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", "lab/gpu/check.sh", str(call)], cwd=REPO, env=full, capture_output=True,
                          text=True, timeout=900)


def step_jsons(out: Path, call: int) -> dict[str, dict]:
    return {name: json.loads((out / f"{name}.json").read_text()) for name in KEYS[call]}


@pytest.mark.slow  # 174 s in pytest here (it builds the CPU kernels afresh), 97 s as make gpu-check-dry
def test_the_dry_run_writes_every_json_with_the_keys_the_docs_name(tmp_path):
    for call in (1, 2):
        out = tmp_path / f"call{call}"
        proc = run_call(call, out)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert len(list(out.iterdir())) <= 8  # what the device tool brings back from $OUT
        for name, report in step_jsons(out, call).items():
            assert set(report["check"]) == CHECK and report["check"]["rc"] == 0, (name, report.get("log_tail"))
            assert KEYS[call][name] <= set(report), (name, KEYS[call][name] - set(report))
    proj = json.loads((tmp_path / "call1" / "d_projection.json").read_text())
    chain = proj["replay"]["chain"]
    assert chain["follows_script"] and proj["replay"]["ar"]["follows_script"]
    assert chain["passes_ms_per_token"] > 0
    assert chain["passes_ms_per_token"] + chain["host_ms_per_token"] == pytest.approx(chain["ms_per_token"])
    fp32 = json.loads((tmp_path / "call2" / "f_bench_fp32.json").read_text())
    assert fp32["mismatches"] == [] and set(fp32["overall"]) == {"ar", "default"}


def test_a_spent_budget_still_leaves_every_json(tmp_path):
    proc = run_call(1, tmp_path, GPU_CHECK_BUDGET="3")
    assert proc.returncode == 0, proc.stderr
    for name, report in step_jsons(tmp_path, 1).items():
        assert report["check"]["rc"] == 125 and report["check"]["step"] == name


def test_a_step_past_its_limit_is_cut_and_still_leaves_its_json(tmp_path):
    proc = run_call(1, tmp_path, GPU_CHECK_LIMIT="1")
    assert proc.returncode == 0, proc.stderr
    reports = step_jsons(tmp_path, 1)
    for name in ("a_tests", "c_shape_bench"):  # each imports torch: never done in a second
        check = reports[name]["check"]
        assert check["timed_out"] and check["limit"] == 1 and check["seconds"] <= 8, (name, check)
    assert "log_tail" in reports["c_shape_bench"]
    assert "log_tail" in reports["a_tests"] or "counts" in reports["a_tests"]  # pytest reports what ran on INT


def test_the_two_calls_fit_the_device_tool(tmp_path):
    plan = lab_module("gpu/plan.py")
    assert [c["call"] for c in plan.CALLS] == [1, 2]
    assert [c["timeout_s"] for c in plan.CALLS] == [480, 300]  # 8 and 5 minutes: 13 of the lease's 15
    for call in plan.CALLS:
        assert len(call["carry"]) <= 8 and len(call["command"]) <= 2000
    first, second = plan.CALLS
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "a.whl").write_bytes(b"x" * 1000)
    (tmp_path / ".gpu").mkdir()
    with open(tmp_path / ".gpu" / "smollm2.aa", "wb") as f:
        f.truncate(59 << 20)  # sparse: its size counts, not its blocks
    ok = plan.check_call(first, tmp_path, tree=512 << 10)
    assert ok["problems"] == [] and ok["total_MiB"] < 60
    over = plan.check_call(first, tmp_path, tree=2 << 20)
    assert any("over 60 MiB" in p for p in over["problems"])
    missing = plan.check_call(second, tmp_path, tree=0)
    assert any(".gpu/kit is missing: make demo" in p for p in missing["problems"])


def test_the_replay_drives_the_decoder_with_the_recorded_acceptance(monkeypatch):
    import torch

    monkeypatch.setenv("POLYSPEC_CPU_KERNELS", "0")  # the decoder's mechanics; the C++ kernels need not be built

    proj = lab_module("gpu/projection.py")
    models, _ = proj.build("tiny", torch.device("cpu"), torch.float32, lambda m: None)
    vocab = models["target"].args.vocab_size
    prompt = list(range(3, 19))
    span = range(len(prompt) + 80)
    runs = {}
    for name, miss_int4, miss_head in (("agree", set(), set()), ("miss", set(span[::3]), set(span[::2]))):
        script = proj.Script(vocab, miss_int4, miss_head)
        runs[name] = proj.decode_run(models, script, chain=True, k=3, mu=6, prompt=prompt, new_tokens=40,
                                     repeats=1)
        assert runs[name]["follows_script"]  # the target's script, whatever the levels below proposed
    int4 = {n: r["levels"][1]["mean_accepted"] for n, r in runs.items()}
    target = {n: r["levels"][0]["mean_accepted"] for n, r in runs.items()}
    assert int4["agree"] == 4.0  # every head draft accepted: k + 1 tokens per int4 verification
    assert int4["miss"] < 2.0 and target["miss"] < target["agree"]


def test_the_int4_sweep_plans_cover_k_once_and_start_with_the_shipped_plan():
    from polyspec.decode import int4_triton as T

    sweep = lab_module("gpu/int4_sweep.py")
    for (n, k), rows in ((s, r) for s in sweep.SHAPES for r in sweep.ROWS):
        plans = sweep.plans(n, k, 128, rows, 132)
        assert plans[0] == ("shipped", T.plan(n, k, 128, rows, 132)) and len(plans) > 3
        blocks = T.padded_k(k, 128) // (4 * plans[0][1].units)
        for label, p in plans:
            per = p.blocks_per_split
            assert (p.splits - 1) * per < blocks <= p.splits * per, (n, k, rows, label)  # no empty split, no K lost
            assert p.tile.block_m == plans[0][1].tile.block_m and p.tile.block_n in (64, 128)
        assert len({p for _, p in plans}) == len(plans)
