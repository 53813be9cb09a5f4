"""The one home of each small decision: device and dtype, rank zero, mode names, atomic files, forward timing."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch

from polyspec.decode.timing import timed
from polyspec.device import device_name, is_global_rank_zero, resolve_device, resolve_dtype
from polyspec.errors import PolyspecError
from polyspec.fsutil import atomic_file, write_json
from polyspec.modes import MODES, mode_of


def test_device_and_dtype_resolution():
    assert device_name("cpu") == "cpu" and device_name("cuda:1") == "cuda:1"
    assert device_name("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_dtype(None, torch.device("cpu")) is torch.float32
    assert resolve_dtype(None, "cuda:0") is torch.bfloat16  # the default follows the device, no GPU needed
    assert resolve_dtype("float16", "cpu") is torch.float16
    with pytest.raises(PolyspecError, match="not one of"):
        resolve_dtype("int8", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(PolyspecError, match="CUDA is not available"):
            resolve_device("cuda")


@pytest.mark.parametrize("flags, mkldnn, fast", [
    ("fpu avx512f avx512bw avx512_vnni", True, False),  # Cascade Lake: oneDNN emulates bf16, slower than fp32
    ("fpu avx512f avx512_bf16", True, True),
    ("fpu amx_tile amx_bf16", True, True),
    ("fp asimd bf16", True, True),  # Arm's Features line
    ("", True, True),  # no /proc/cpuinfo: oneDNN's word
    ("fpu avx512_bf16", False, False),
])
def test_bf16_matmul_is_fast_only_with_bf16_instructions(monkeypatch, flags, mkldnn, fast):
    from polyspec import device

    monkeypatch.setattr(device, "cpu_flags", lambda: flags)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn)
    assert device.fast_bf16_matmul("cpu") is fast
    assert device.fast_bf16_matmul("cuda") is True


@pytest.mark.parametrize("env, rank0", [({}, True), ({"RANK": "0", "LOCAL_RANK": ""}, True), ({"RANK": "1"}, False),
                                        ({"LOCAL_RANK": "2"}, False), ({"NODE_RANK": "1"}, False)])
def test_global_rank_zero(monkeypatch, env, rank0):
    for v in ("RANK", "LOCAL_RANK", "NODE_RANK"):
        monkeypatch.delenv(v, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert is_global_rank_zero() is rank0


def test_mode_names():
    assert MODES == ("ar", "dual", "chain")
    assert [mode_of(n) for n in (1, 2, 3, 4, 7)] == ["ar", "dual", "chain", "chain", "chain"]


def test_atomic_file_writes_whole_files_or_nothing(tmp_path):
    path = write_json(tmp_path / "sub" / "r.json", {"a": [1, 2]})
    assert json.loads(path.read_text()) == {"a": [1, 2]} and path.read_text().endswith("\n")
    assert os.stat(path).st_mode & 0o777 == 0o644

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        atomic_file(path, half_then_fail)
    assert json.loads(path.read_text()) == {"a": [1, 2]}  # the old file stands
    assert sorted(p.name for p in path.parent.iterdir()) == ["r.json"]  # no temporary left behind


def test_timed_returns_the_result_and_the_wall_time():
    out, seconds = timed(lambda: time.sleep(0.02) or 7, "cpu")
    assert out == 7 and 0.02 <= seconds < 1.0


def test_in_fresh_process_returns_raises_and_reports_a_dead_child(tmp_path):
    from polyspec.config import load_recipe
    from polyspec.isolate import in_fresh_process

    assert in_fresh_process("pid", os.getpid) not in (os.getpid(), None)  # it ran, and not here
    with pytest.raises(PolyspecError) as e:  # the child's error, its exit code kept
        in_fresh_process("recipe", load_recipe, tmp_path / "missing.yaml")
    assert e.value.exit_code == 2 and "missing.yaml" in str(e.value)
    with pytest.raises(PolyspecError, match="exit: its worker process died") as e:
        in_fresh_process("exit", os._exit, 3)
    assert e.value.exit_code == 1


def test_heap_kept_serves_large_allocations_from_the_heap_and_restores_glibcs_defaults():
    """polyspec.device.heap_kept: inside, a 64 MB allocation comes from the heap (no new mmap'd bytes); before and
    after, glibc maps it (its default above 32 MB). Skipped where the C library is not glibc."""
    import ctypes

    from polyspec.device import _glibc, heap_kept

    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        pytest.skip("not glibc >= 2.33")

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                    "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    size = 64 << 20

    def mapped_by_one_allocation() -> int:
        before = libc.mallinfo2().hblkhd
        p = libc.malloc(size)
        assert p
        mapped = libc.mallinfo2().hblkhd - before
        libc.free(p)
        return mapped

    assert mapped_by_one_allocation() >= size
    with heap_kept() as applied:
        assert applied
        assert mapped_by_one_allocation() == 0
    assert mapped_by_one_allocation() >= size
