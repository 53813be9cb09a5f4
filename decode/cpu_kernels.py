"""The CPU fast path of the decoder at decode/verify widths (1 to VERIFY_ROWS positions), beside the pure-torch path.

At batch 1 a decode step streams every weight once, so its speed is memory bandwidth. torch's fp32 CPU GEMM runs a
single-threaded GEMV at one row (~10 GB/s on a 2-core EPYC that reads 30+ GB/s) and a packing GEMM for a few rows
(re-reading the weights). ``cpu_kernels.cpp`` streams each weight row once for all rows of the input, on torch's OpenMP
threads, for fp32 and bf16 weights (fp32 accumulation) and GPTQ-layout int4 weights (:func:`int4_linear`), and runs a
whole decoder layer in one call (:func:`run_layers`) for the layers :data:`LAYER_SUPPORT` declares (every other layer
runs decode/model.py's DecoderLayer, the reference). :func:`pack_weights` puts a loaded model's
weights in one block in the order a step reads them. docs/KERNELS.md describes the design.

The kernels are batch-invariant: a row's output is bitwise the same whether it is computed alone or with any number
of others, so a verification over k + 1 positions (or a draft tree's nodes) gives each position exactly the logits a
decode step gives it, in fp32 and bf16. Which forwards they take (:func:`rows_limit`): up to MAX_ROWS rows always,
and up to VERIFY_ROWS for a verification, whose rows must match a decode step's; a wider prompt goes to torch's GEMM,
except over bf16 weights in 16-row blocks, which take any causal block in forwards of VERIFY_ROWS
(:func:`blocked_layers`).

Build: the first call compiles ``cpu_kernels.cpp`` with the system C++ compiler (``g++ -O3 -march=native -fopenmp``,
about 2 s) into ``$POLYSPEC_KERNEL_CACHE`` (default ``~/.cache/polyspec/kernels``), keyed by the source, the compiler
and this CPU's flags, written under a temporary name and renamed. No compiler, a failed build, or
``POLYSPEC_CPU_KERNELS=0`` -> every call takes the torch path (one note on stderr for a failed build). The library
links ``libgomp.so.1``, the OpenMP runtime torch's CPU wheel already loaded, so both share one thread pool.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import itertools
import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from polyspec.errors import PolyspecError

_ABI = 17
MAX_ROWS = 16  # rows any forward takes the kernels for; a wider prompt goes to torch's GEMM (rows_limit)
VERIFY_ROWS = 64  # rows a verification (rows_limit) takes them for: exactness first (at 33 rows 1.13x torch's time)
_SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _flags() -> list[str]:
    """The compiler flags; POLYSPEC_PORTABLE_ROWS=1 builds the portable fp32 rows for int4 and bf16 weights even
    where AVX512-BF16 is there (the tests compare both paths this way); =avx2 builds them without AVX-512 too, as an
    AVX2 CPU's -march=native does (256-bit vectors, 16 registers); =half with 256-bit vectors and AVX-512's 32
    registers, this core's multiply rate halved as on a Zen 4-class core (docs/KERNELS.md); =bf16-emulated builds
    the AVX512-BF16 rows on an AVX-512 CPU without the instruction, vdpbf16ps emulated (the tests run them so)."""
    portable = os.environ.get("POLYSPEC_PORTABLE_ROWS", "").strip().lower()
    if portable not in ("", "0", "1", "avx2", "half", "bf16-emulated"):
        raise PolyspecError(f"POLYSPEC_PORTABLE_ROWS must be 1, avx2, half or bf16-emulated (got {portable!r}); unset "
                            "it for this CPU's own row kernels")
    locality = f"-DPOLYSPEC_PREFETCH_LOCALITY={prefetch_locality()}"
    if portable == "bf16-emulated":  # the vdpbf16ps rows on an AVX-512 CPU without the instruction (tests)
        return _FLAGS + [locality, "-DPOLYSPEC_EMULATE_DPBF16"]
    extra = ["-DPOLYSPEC_PORTABLE_ROWS"] if portable not in ("", "0") else []
    if portable == "avx2":
        extra += ["-mno-avx512f", "-Wno-psabi"]
    if portable == "half":
        extra += ["-DPOLYSPEC_HALF_WIDTH"]
    return _FLAGS + [locality] + extra


def _setting(name: str, allowed: tuple[str, ...], default: str) -> str:
    """Environment setting ``name``: one of ``allowed`` (unset or empty: ``default``); anything else is one clear
    error."""
    value = os.environ.get(name, default).strip().lower() or default
    if value not in allowed:
        listed = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise PolyspecError(f"{name} must be {listed} (got {value!r}); unset it for the default ({default})")
    return value


def prefetch_locality() -> int:
    """The weight stream's prefetch hint (cpu_kernels.cpp, prefetch_ahead): 0 (non-temporal) on AMD, where it was
    measured best, 1 (prefetcht2) elsewhere: on an Intel Xeon non-temporal prefetches made the layers 2.6x slower.
    POLYSPEC_PREFETCH_LOCALITY (0-3) overrides it."""
    from polyspec.device import cpu_vendor

    env = os.environ.get("POLYSPEC_PREFETCH_LOCALITY", "").strip()
    if env:
        if env not in ("0", "1", "2", "3"):
            raise PolyspecError(f"POLYSPEC_PREFETCH_LOCALITY must be 0, 1, 2 or 3 (got {env!r}); unset it for the "
                                "CPU's default")
        return int(env)
    return 0 if cpu_vendor() == "AuthenticAMD" else 1

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_failure: str | None = None
_scopes = itertools.count(1)
_frozen = threading.local()  # .scope: this thread's weights_frozen span (0 or absent: none)


@contextlib.contextmanager
def weights_frozen():
    """A span of forwards (one generation) over which the caller promises that no weight changes in place and no
    plan is dropped: :func:`layer_block` then checks each cached block against its layers once per span, not per
    forward (reading the versions of a model's ~210 tensors took ~90 us a forward, cold after the weight stream).
    Per thread; spans nest."""
    outer = getattr(_frozen, "scope", 0)
    _frozen.scope = next(_scopes)
    try:
        yield
    finally:
        _frozen.scope = outer


def frozen_scope() -> int:
    """This thread's innermost :func:`weights_frozen` span (0: none): what a model keys the arguments of its kernel
    calls on (built once per span)."""
    return getattr(_frozen, "scope", 0)


class SpanKept:
    """What a model keeps for one cache through one :func:`weights_frozen` span (one generation): the arguments of
    its kernel calls, whose checks and pointer reads cost tens of microseconds each after a forward's weight stream.
    A copy or a pickle of the model drops it (it holds raw pointers)."""

    __slots__ = ("scope", "cache", "value")

    def __init__(self, cache, value) -> None:
        self.scope, self.cache, self.value = frozen_scope(), cache, value

    def current(self, cache) -> bool:
        """Still for this cache, in the same span, with the fast path on."""
        return self.cache is cache and _enabled and self.scope == frozen_scope()

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


def _env_enabled() -> bool:
    return os.environ.get("POLYSPEC_CPU_KERNELS", "1").strip().lower() not in {"0", "false", "off", "no"}


_enabled = _env_enabled()


def _ready() -> bool:
    """The fast path is on and the library is loaded or not yet tried (cheap: no build attempt)."""
    return _enabled and (_lib is not None or not _tried)


def set_enabled(flag: bool) -> bool:
    """Turn the fast path on or off for this process; returns the previous setting."""
    global _enabled
    old, _enabled = _enabled, bool(flag)
    return old


def cache_dir() -> Path:
    env = os.environ.get("POLYSPEC_KERNEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "polyspec" / "kernels"


def _cpu_flags() -> str:
    from polyspec.device import cpu_flags

    return cpu_flags() or platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return cxx


def library_path() -> Path | None:
    """Where the compiled library for this source, compiler and CPU lives (None without a compiler)."""
    cxx = _compiler()
    if cxx is None:
        return None
    key = hashlib.sha256()
    for part in (_SOURCE.read_bytes(), " ".join(_flags()).encode(), _compiler_id(cxx).encode(),
                 platform.machine().encode(), _cpu_flags().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / f"polyspec_kernels_{key.hexdigest()[:16]}.so"


def build(force: bool = False) -> Path:
    """Compile the kernel library if it is not cached (atomically); return its path. Raises RuntimeError."""
    path = library_path()
    if path is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++)")
    if path.exists() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp.so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([_compiler(), *_flags(), str(_SOURCE), "-o", tmp], capture_output=True, text=True,
                              timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {_SOURCE.name} failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def _declare(lib: ctypes.CDLL) -> None:
    """The argument and result types of the library's entry points."""
    argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 5 + [ctypes.c_void_p, ctypes.c_int]
    lib.polyspec_linear3_f32.argtypes, lib.polyspec_linear3_f32.restype = argtypes, None
    lib.polyspec_linear3_bf16w.argtypes = argtypes + [ctypes.c_int] + [ctypes.c_void_p] * 3
    lib.polyspec_linear3_bf16w.restype = None
    lib.polyspec_layer_f32.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_float]
                                       + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 4
                                       + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int])
    lib.polyspec_layer_f32.restype = ctypes.c_int
    lib.polyspec_layer_bf16.argtypes = lib.polyspec_layer_f32.argtypes
    lib.polyspec_layer_bf16.restype = ctypes.c_int
    lib.polyspec_layer_i4.argtypes = ([ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_float]
                                      + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 4
                                      + [ctypes.c_int64] * 2 + [ctypes.c_void_p, ctypes.c_int])
    lib.polyspec_layer_i4.restype = ctypes.c_int
    lib.polyspec_linear_i4.argtypes = ([ctypes.c_void_p] * 5 + [ctypes.c_int64] * 4
                                       + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p])
    lib.polyspec_linear_i4.restype = ctypes.c_int
    lib.polyspec_dot_path.argtypes, lib.polyspec_dot_path.restype = [], ctypes.c_int
    lib.polyspec_set_bf16_dot.argtypes, lib.polyspec_set_bf16_dot.restype = [ctypes.c_int], None
    lib.polyspec_pack_nk16.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.polyspec_pack_nk16.restype = None
    lib.polyspec_round_bf16.argtypes, lib.polyspec_round_bf16.restype = [ctypes.c_void_p, ctypes.c_int64], None
    lib.polyspec_row_lanes.argtypes, lib.polyspec_row_lanes.restype = [], ctypes.c_int
    lib.polyspec_i4_vnni.argtypes, lib.polyspec_i4_vnni.restype = [], ctypes.c_int
    lib.polyspec_pack_i4v.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    lib.polyspec_pack_i4v.restype = None
    lib.polyspec_pack_q8v.argtypes = lib.polyspec_pack_i4v.argtypes
    lib.polyspec_pack_q8v.restype = None
    lib.polyspec_linear_q8v.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4 + [ctypes.c_void_p,
                                                                                     ctypes.c_int]
    lib.polyspec_linear_q8v.restype = ctypes.c_int
    for name in ("polyspec_attention_bf16", "polyspec_attention_f32"):
        getattr(lib, name).argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 6 + [ctypes.c_void_p,
                                                                                        ctypes.c_int,
                                                                                        ctypes.c_void_p]
        getattr(lib, name).restype = ctypes.c_int
    _declare_one_calls(lib)


def _declare_one_calls(lib: ctypes.CDLL) -> None:
    """The entry points that run a whole step in one call (a block of layers, a forward, a head step) and its
    reductions."""
    lib.polyspec_head_step_bf16.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_void_p]
                                            + [ctypes.c_int64] * 2
                                            + [ctypes.c_void_p] * 3 + [ctypes.c_float]
                                            + [ctypes.c_int64] * 4 + [ctypes.c_void_p] * 4
                                            + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2
                                            + [ctypes.c_int64, ctypes.c_void_p] + [ctypes.c_int64] * 2
                                            + [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2)
    lib.polyspec_head_step_bf16.restype = ctypes.c_int
    lib.polyspec_layers.argtypes = ([ctypes.c_int, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                     ctypes.c_float] + [ctypes.c_int64] * 6 + [ctypes.c_void_p] * 3
                                    + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int64, ctypes.c_int])
    lib.polyspec_layers.restype = ctypes.c_int
    lib.polyspec_final_norm_bf16.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_float] + [ctypes.c_int64] * 2 + [
        ctypes.c_void_p]
    lib.polyspec_final_norm_bf16.restype = None
    lib.polyspec_forward_bf16.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_void_p,
                                          ctypes.c_int64, ctypes.c_float] + [ctypes.c_int64] * 4
                                          + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
                                          + [ctypes.c_void_p] * 2 + [ctypes.c_int64]
                                          + [ctypes.c_void_p, ctypes.c_float] + [ctypes.c_void_p] * 2
                                          + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 2 + [ctypes.c_int])
    lib.polyspec_forward_bf16.restype = ctypes.c_int


def _load() -> ctypes.CDLL | None:
    global _lib, _tried, _failure, _bf16_choice
    if _tried:
        return _lib
    _bf16_rows_env()  # a bad setting is an error before anything is built
    with _lock:
        if _tried:
            return _lib
        try:
            lib = ctypes.CDLL(str(build()))
            if lib.polyspec_linear_abi() != _ABI:
                raise RuntimeError("the cached library has another ABI version")
            _declare(lib)
            _bf16_choice = _choose_bf16_rows(lib)
            lib.polyspec_set_bf16_dot(int(_bf16_choice is None or _bf16_choice[0] == "dot"))
            _lib = lib
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _failure = str(e)
            print(f"polyspec: the CPU linear kernel is unavailable, using torch's F.linear ({e})", file=sys.stderr)
        _tried = True
    return _lib


def available() -> bool:
    """True when the kernel library is (or can be) built and loaded and the fast path is enabled."""
    return _enabled and _load() is not None


def state() -> str:
    """One line for reports and stamps: "on (LIBRARY, its row kernels, prefetch hint, 16-row blocks)", "off
    (POLYSPEC_CPU_KERNELS)" or "unavailable (WHY)"."""
    if not _enabled:
        return "off (POLYSPEC_CPU_KERNELS or set_enabled)"
    if _load() is None:
        return f"unavailable ({_failure})"
    blocks = "on" if _blocks_wanted() else "off"
    i4 = "on" if _i4_blocks_wanted() else "off"
    bf16 = "" if _bf16_choice is None else f"bf16 inputs on the {_bf16_choice[0]} rows ({_bf16_choice[1]}), "
    return (f"on ({library_path().name}, int4 and bf16 rows: {dot_path()}, {bf16}prefetch locality "
            f"{prefetch_locality()}, 16-row blocks {blocks}, int4 x int8 blocks {i4})")


def dot_path() -> str | None:
    """Which row kernels the loaded library runs for int4 weights and for bf16 weights under bf16 inputs:
    "avx512-bf16" (activations rounded to bf16, vdpbf16ps; "avx512-bf16 (emulated)" in the bf16-emulated build) or
    "fp32" (portable: fp32 activations, weights widened; "fp32/8-lane" where its vectors are 256-bit: an AVX2 CPU or
    the half-width build); None when the library is not loaded."""
    if not _enabled or _load() is None:
        return None
    if _lib.polyspec_dot_path() == 1:
        return "avx512-bf16"
    if _lib.polyspec_dot_path() == 2:
        return "avx512-bf16 (emulated)"
    lanes = _lib.polyspec_row_lanes()
    return "fp32" if lanes == 16 else f"fp32/{lanes}-lane"


# bf16 inputs on a vdpbf16ps build (cpu_kernels.cpp, g_bf16_dot): the dot rows, or the 16-row blocks on vdpbf16ps
# (rows_nk16_dp). The dot rows read the weights row by row and end each (row, input) in a lane sum; the blocks feed
# each loaded weight vector to every input of a pass and need no sums. A Zen 4-class core, which issues 512-bit
# operations in halves, verified 5 rows at 1.6-2.0x a decode step's time on the dot rows (issue 48); which is faster
# depends on the core, so the choice is measured, once per library and CPU, and kept beside the library.

BF16_ROWS_WIDTHS = (1, 2, 4, 8)  # the widths timed; the kind with the smaller sum of medians is chosen
_BF16_ROWS_SHAPE = (4096, 2048)  # [N, K] of each timed weight: 6 of them, 96 MB, stream from memory as a model's do
_bf16_choice: tuple[str, str] | None = None  # ("dot" | "blocks", why), set when a vdpbf16ps library loads


def _bf16_rows_env() -> str:
    return _setting("POLYSPEC_BF16_ROWS", ("auto", "dot", "blocks"), "auto")  # auto: measured on this CPU


def _time_bf16_rows(lib: ctypes.CDLL, repeats: int = 5) -> dict[str, list[float]]:
    """Median seconds of bf16 weights against bf16 input rows at each of BF16_ROWS_WIDTHS, on the dot rows and on
    the 16-row blocks, the two taking turns."""
    n, k = _BF16_ROWS_SHAPE
    g = torch.Generator().manual_seed(0)
    ws = [(torch.randn(n, k, generator=g) * 0.02).to(torch.bfloat16) for _ in range(6)]
    blks = [torch.empty(_block_words(w), dtype=torch.int32) for w in ws]
    for w, b in zip(ws, blks, strict=True):
        lib.polyspec_pack_nk16(w.data_ptr(), n, k, b.data_ptr())
    x = torch.randn(max(BF16_ROWS_WIDTHS), k, generator=g).to(torch.bfloat16).float()
    y = torch.empty(max(BF16_ROWS_WIDTHS), n)
    times: dict[str, dict[int, list[float]]] = {kind: {m: [] for m in BF16_ROWS_WIDTHS} for kind in ("dot", "blocks")}
    for _ in range(repeats):
        for m in BF16_ROWS_WIDTHS:
            for kind, t in times.items():
                lib.polyspec_set_bf16_dot(int(kind == "dot"))
                t0 = time.perf_counter()
                for w, b in zip(ws, blks, strict=True):
                    lib.polyspec_linear3_bf16w(x.data_ptr(), w.data_ptr(), w.data_ptr(), w.data_ptr(), None, None,
                                               None, n, 0, 0, m, k, y.data_ptr(), torch.get_num_threads(), 1,
                                               b.data_ptr(), b.data_ptr(), b.data_ptr())
                t[m].append(time.perf_counter() - t0)
    return {kind: [statistics.median(t[m]) for m in BF16_ROWS_WIDTHS] for kind, t in times.items()}


def pick_bf16_rows(seconds: dict[str, list[float]]) -> str:
    """The kind whose times over BF16_ROWS_WIDTHS sum smaller ("dot" on a tie)."""
    return "blocks" if sum(seconds["blocks"]) < sum(seconds["dot"]) else "dot"


def _choose_bf16_rows(lib: ctypes.CDLL) -> tuple[str, str] | None:
    """What bf16 inputs take on a vdpbf16ps library (None on another): POLYSPEC_BF16_ROWS's choice, the dot rows
    without 16-row blocks (POLYSPEC_ROW_BLOCKS=0), else the measured one, read from beside the library or measured
    now (about a second) and written there."""
    if lib.polyspec_dot_path() == 0:
        return None
    env = _bf16_rows_env()
    if env != "auto":
        return env, "POLYSPEC_BF16_ROWS"
    if not _row_blocks_allowed():
        return "dot", "POLYSPEC_ROW_BLOCKS=0"
    path = library_path().with_suffix(".bf16-rows.json")
    try:
        kept = json.loads(path.read_text())["choice"]
        if kept in ("dot", "blocks"):
            return kept, "measured"
    except (OSError, ValueError, KeyError, TypeError):
        pass  # none kept yet, or unreadable: measured again below
    seconds = _time_bf16_rows(lib)
    record = {"choice": pick_bf16_rows(seconds), "widths": list(BF16_ROWS_WIDTHS), "seconds": seconds,
              "shape": list(_BF16_ROWS_SHAPE), "threads": torch.get_num_threads()}
    try:  # kept for the next process; where it cannot be written, the next one measures again
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, path)
    except OSError:
        pass
    return record["choice"], "measured"


def bf16_rows() -> str | None:
    """What bf16 inputs take on this library: "dot" (the vdpbf16ps rows) or "blocks" (the 16-row blocks on
    vdpbf16ps); None where the library has no vdpbf16ps rows (the widened blocks or rows then) or is not loaded."""
    if not _enabled or _load() is None:
        return None
    return None if _bf16_choice is None else _bf16_choice[0]


def failure() -> str | None:
    """Why the last load failed (None if it did not, or was not tried)."""
    return _failure


def supports(x: torch.Tensor, weight: torch.Tensor, max_rows: int = MAX_ROWS) -> bool:
    """Whether :func:`kernel_linear` takes this call: CPU tensors, both fp32 or both bf16 (or an fp32 input with bf16
    weights: fp32 output), at most ``max_rows`` input rows (:func:`rows_limit`), a contiguous 2-D weight, no autograd
    graph to build, and no tracer or compiler watching."""
    if not (x.is_cpu and weight.is_cpu) or weight.dim() != 2 or not weight.is_contiguous():
        return False
    mixed = x.dtype == torch.float32 and weight.dtype == torch.bfloat16  # a 16-bit lm_head in an fp32 model
    if not mixed and (x.dtype != weight.dtype or x.dtype not in (torch.float32, torch.bfloat16)):
        return False
    k = weight.shape[1]
    if x.shape[-1] != k or x.numel() == 0 or x.numel() > min(max_rows, VERIFY_ROWS) * k:
        return False
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return False
    if torch.jit.is_tracing() or torch.compiler.is_compiling():  # ONNX export, torch.compile: stay traceable
        return False
    return True


def kernel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  *more: tuple[torch.Tensor, torch.Tensor | None], fp32_out: bool = False) -> torch.Tensor:
    """The kernel's ``F.linear(x, weight, bias)``; with ``more`` (up to two further (weight, bias) pairs of the same
    in_features and dtype) the outputs side by side, ``torch.cat([F.linear(x, w, b) for ...], -1)``, in one call.
    The caller checked :func:`supports` (for every weight) and :func:`available`. Output dtype is x's (bf16 weights:
    fp32 accumulation, rounded to bf16 once); ``fp32_out``: float32 instead, holding those same rounded values
    (``.float()`` of the bf16 result, without its two copies: a bf16 model's logits)."""
    q8 = None if more or x.dtype != torch.float32 else q8_lm_head_of(weight)
    if q8 is not None:  # an int4 level's lm_head (make_q8_lm_head)
        return _q8_linear(x, q8, bias, weight.shape[0])
    pairs = ((weight, bias), *more)
    if len(pairs) > 3:
        raise ValueError("kernel_linear takes at most three weights")
    k = weight.shape[1]
    fp32 = x.dtype == torch.float32
    xf = x.contiguous() if fp32 else x.float().contiguous()
    if any(w.dtype != weight.dtype for w, _ in pairs):
        raise ValueError("kernel_linear: the weights of one call must share a dtype")
    ws, bs, ns, blks = [0, 0, 0], [None, None, None], [0, 0, 0], [None, None, None]
    keep = []  # converted biases must outlive the call
    for i, (w, b) in enumerate(pairs):
        ws[i], ns[i], blks[i] = w.data_ptr(), w.shape[0], blocks_ptr(w)
        if b is not None:
            b = b.float().contiguous()
            keep.append(b)
            bs[i] = b.data_ptr()
    y = torch.empty((*x.shape[:-1], ns[0] + ns[1] + ns[2]), dtype=torch.float32)
    args = (xf.data_ptr(), *ws, *bs, *ns, xf.numel() // k, k, y.data_ptr(), torch.get_num_threads())
    if weight.dtype == torch.float32:
        _lib.polyspec_linear3_f32(*args)
    else:  # a bf16 input (rounding it back to bf16 is exact) may take the vdpbf16ps rows; fp32_out: rounded there
        _lib.polyspec_linear3_bf16w(*args, 0 if fp32 else (1 | (2 if fp32_out else 0)), *blks)
    if fp32 or fp32_out:
        return y
    return y.to(x.dtype)


def fused_linears(x: torch.Tensor, linears: list[torch.nn.Module]) -> torch.Tensor | None:
    """``torch.cat([lin(x) for lin in linears], -1)`` (two or three model.Linear layers of the same in_features and
    dtype) from one kernel call, or None when the fast path does not take them (then call the layers)."""
    if not _ready():
        return None
    for lin in linears:
        if type(lin).forward is not _linear_forward or not supports(x, lin.weight):
            return None
    if _load() is None:
        return None
    return kernel_linear(x, linears[0].weight, linears[0].bias, *((lin.weight, lin.bias) for lin in linears[1:]))


_linear_forward = None  # model.Linear.forward, registered by model.py (only those layers are known to be plain)


def register_linear_class(cls: type) -> None:
    """Declare ``cls`` (decode.model.Linear) as the layer class :func:`fused_linears` may take over."""
    global _linear_forward
    _linear_forward = cls.forward


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           max_rows: int = MAX_ROWS, fp32_out: bool = False) -> torch.Tensor:
    """``F.linear`` with the CPU kernel where it applies (see :func:`supports`); an fp32 input with bf16 weights gives
    fp32 (the weights widened: on the torch path, a widened copy per call). ``fp32_out``: the result's ``.float()``
    (from the kernel without the bf16 copy: :func:`kernel_linear`). bf16 weights in 16-row blocks (:func:`blocks_of`:
    a build without AVX512-BF16, where torch's GEMM widens them at ~40 GFLOP/s) take any number of rows, VERIFY_ROWS
    at a time (each row's result is the same in any call: a prompt's fc in an EAGLE head, 1.61 against torch's
    3.08 ms at 125 rows, half-width build)."""
    if _ready() and _load() is not None:
        if supports(x, weight, max_rows):
            return kernel_linear(x, weight, bias, fp32_out=fp32_out)
        rows = x.reshape(-1, x.shape[-1]) if x.dim() >= 2 else x
        if rows.dim() == 2 and supports(rows[:VERIFY_ROWS], weight, VERIFY_ROWS) and blocks_of(weight) is not None:
            y = torch.cat([kernel_linear(rows[i:i + VERIFY_ROWS], weight, bias, fp32_out=fp32_out)
                           for i in range(0, rows.shape[0], VERIFY_ROWS)])
            return y.reshape(*x.shape[:-1], y.shape[-1])
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
        bias = None if bias is None else bias.to(x.dtype)
    y = F.linear(x, weight, bias)
    return y.float() if fp32_out else y


# ---------------------------------------------------------------------------------------------------------------
# Int4 (decode/int4.py's Int4Linear buffers: codes two per byte, fp32 scales, uint8 zeros per group)
# ---------------------------------------------------------------------------------------------------------------


def _int4_reference() -> bool:
    """POLYSPEC_INT4_REFERENCE=1 (decode/int4.py) asks for the dequantised reference matmul: no kernel then."""
    return os.environ.get("POLYSPEC_INT4_REFERENCE", "") not in ("", "0")


def int4_layer_ok(mod: torch.nn.Module) -> bool:
    """Whether an Int4Linear's buffers suit the kernel: CPU, K and group size multiples of 32, the expected dtypes,
    contiguous, fp32 bias or none."""
    k, gs = mod.in_features, mod.group_size
    if k % 32 or gs % 32 or not mod.qdata.is_cpu:
        return False
    b = mod.bias
    if b is not None and (b.dtype != torch.float32 or not b.is_contiguous()):
        return False
    return (mod.qdata.dtype == torch.uint8 and mod.qdata.is_contiguous() and mod.scales.dtype == torch.float32
            and mod.scales.is_contiguous() and mod.zeros.dtype == torch.uint8 and mod.zeros.is_contiguous())


def int4_linear(x: torch.Tensor, mod: torch.nn.Module) -> torch.Tensor | None:
    """``mod(x)`` for an Int4Linear through the kernel (fp32 input [..., K], at most MAX_ROWS rows, no autograd),
    or None when it does not apply (then the caller takes torch's path)."""
    if not _ready() or x.dtype != torch.float32 or not x.is_cpu:
        return None
    if _int4_reference():
        return None
    k = mod.in_features
    if x.shape[-1] != k or x.numel() == 0 or x.numel() > MAX_ROWS * k or not int4_layer_ok(mod):
        return None
    if (torch.is_grad_enabled() and x.requires_grad) or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return None
    if _load() is None:
        return None
    xf = x.contiguous()
    y = torch.empty((*x.shape[:-1], mod.out_features), dtype=torch.float32)
    blk = i4_blocks_of(mod)
    rc = _lib.polyspec_linear_i4(xf.data_ptr(), mod.qdata.data_ptr(), mod.scales.data_ptr(), mod.zeros.data_ptr(),
                                 None if mod.bias is None else mod.bias.data_ptr(), mod.out_features,
                                 xf.numel() // k, k, mod.group_size, y.data_ptr(), torch.get_num_threads(),
                                 None if blk is None else blk.data_ptr())
    return y if rc == 0 else None


# ---------------------------------------------------------------------------------------------------------------
# Whole decoder layers, one call each (fp32, bf16 or int4 projections)
# ---------------------------------------------------------------------------------------------------------------

_PTRS = ctypes.c_void_p * 23  # 7 weights, 7 biases, 2 norms, 7 weights' 16-row blocks (bf16; NULL: none)
_PTRS_I4 = ctypes.c_void_p * 37  # (codes, scales, zeros) x 7, 7 biases, 2 norms, 7 weights' int8-input blocks


@dataclass(frozen=True)
class LayerSupport:
    """What a fast decoder-layer backend implements, declared in one place: the layer features it computes (names
    from model.layer_features), its projection weight kinds, activation dtypes and widest block. :func:`layer_plan`
    and :func:`block_supported` read it; a layer or block that needs anything else runs the reference Python layer."""

    features: frozenset[str]
    weights: frozenset[str]  # "f32" / "bf16": plain model.Linear weights (and norms) of that dtype; "i4": Int4Linear
    activations: frozenset[torch.dtype]
    max_rows: int  # positions per block (batch 1)

    def missing(self, layer: torch.nn.Module) -> frozenset[str]:
        """The features ``layer`` has that this backend lacks ({"unknown layer"} for a layer that names none)."""
        feats = getattr(layer, "features", None)
        return frozenset({"unknown layer"}) if feats is None else frozenset(feats) - self.features


# cpu_kernels.cpp's layer(): pre-norm RMSNorm (fp64 sum of squares) -> q/k/v with optional biases -> rotate-half RoPE
# over the whole (even) head from the caller's cos/sin -> K/V cache write -> softmax(q k^T / sqrt(D)) under a bool mask,
# kv heads shared by nh / nkv query heads -> o with optional bias -> residual -> RMSNorm -> gate/up with optional
# biases -> SiLU(gate) * up -> down with optional bias -> residual.
LAYER_SUPPORT = LayerSupport(
    features=frozenset({"rms_norm", "rope_rotate_half", "softmax_attention", "silu_glu_mlp", "gqa", "qkv_bias",
                        "o_bias", "mlp_bias"}),
    weights=frozenset({"f32", "bf16", "i4"}),
    activations=frozenset({torch.float32, torch.bfloat16}),
    max_rows=VERIFY_ROWS,
)


def rows_limit(start: int, tree: bool, blocked: bool = False) -> int:
    """The most rows a forward of a block at cache position ``start`` (under a draft tree's mask or not) takes the
    kernels for. A verification's rows must get bitwise a decode step's logits (greedy speculation equals ``ar``
    only then), so it stays on them up to VERIFY_ROWS: a draft tree of 32 nodes plus a lookup path is 41 rows. A
    prompt (a causal block at an empty cache) is the same work in every mode, so above MAX_ROWS it keeps torch's
    GEMM, the faster one from ~30 rows with fp32 weights (docs/KERNELS.md, "Batch invariance"), unless the layers
    are ``blocked`` (:func:`blocked_layers`)."""
    return VERIFY_ROWS if start > 0 or tree or blocked else MAX_ROWS


def step_rows(start: int) -> int:
    """The most rows a causal block at cache position ``start`` takes in one call (rows_limit without a tree, within
    the layer kernel's own limit)."""
    return min(rows_limit(start, False), LAYER_SUPPORT.max_rows)


def blocked_layers(layers: list[torch.nn.Module]) -> bool:
    """Whether every layer runs on the kernels with bf16 weights in 16-row blocks, on a build without AVX512-BF16.
    Those take a prompt too, in forwards of VERIFY_ROWS (model.CachedDecoder._run_layers): there torch's bf16 GEMM
    widens the weights at ~40 GFLOP/s, and a 288-token prompt ran 2.6x faster on the blocks (docs/KERNELS.md, "Batch
    invariance"). With AVX512-BF16 torch's GEMM has the instruction too, so prompts stay on it."""
    if not _ready() or _load() is None or _lib.polyspec_dot_path() != 0:
        return False
    for layer in layers:
        plan = layer_plan(layer)
        if plan is None or not plan.blocked:
            return False
    return bool(layers)


class LayerPlan:
    """What :func:`run_layers` needs of one model.DecoderLayer: its kind ("f32", "bf16" or "i4"), the data
    pointers (7 weights, or 7 x (codes, scales, zeros) for int4; 7 biases or NULL; 2 norm weights), the sizes, and
    references to those tensors (so their memory outlives the plan). A bf16 layer's biases and norm weights are held
    as fp32 copies. Built once per layer by :func:`layer_plan`; DecoderLayer drops it whenever ``Module._apply``
    runs (``.to()``, ``.float()``, ...). In-place updates of the weights keep it valid (not of a bf16 layer's norms
    and biases, which are copies); rebinding a parameter's ``.data`` does not (call :func:`drop_plans` then)."""

    __slots__ = ("kind", "ptrs", "group_size", "eps", "heads", "kv_heads", "head_dim", "intermediate", "tensors",
                 "versions", "blocked")

    def __init__(self, layer: torch.nn.Module, kind: str = "f32", group_size: int = 0):
        att, mlp = layer.self_attn, layer.mlp
        lins = _projections(layer)
        norms = tuple(w.detach().float() for w in (layer.input_layernorm.weight,
                                                   layer.post_attention_layernorm.weight))
        biases = tuple(None if lin.bias is None else lin.bias.detach().float() for lin in lins)
        self.kind, self.group_size = kind, group_size  # group_size: int4 only
        if kind == "i4":
            weights = tuple(t for lin in lins for t in (lin.qdata, lin.scales, lin.zeros))
            blocks = tuple(i4_blocks_of(lin) for lin in lins)
            watched = [(t, b) for lin, b in zip(lins, blocks, strict=True) for t in (lin.qdata, lin.scales, lin.zeros)]
        else:
            weights = tuple(lin.weight.detach() for lin in lins)
            blocks = tuple(blocks_of(lin.weight) if kind == "bf16" else None for lin in lins)
            watched = [(lin.weight, b) for lin, b in zip(lins, blocks, strict=True)]
        # checked on every forward (layer_plan): _version read directly, inference tensors (no counter) left out
        self.versions = tuple((t, t._version) for t, b in watched if b is not None and not t.is_inference())
        self.blocked = kind == "bf16" and all(b is not None for b in blocks)  # bf16 16-row blocks (blocked_layers)
        self.tensors = (*weights, *norms, *(b for b in (*biases, *blocks) if b is not None))
        table = _PTRS_I4 if kind == "i4" else _PTRS
        self.ptrs = table(*(t.data_ptr() for t in weights), *(None if b is None else b.data_ptr() for b in biases),
                          *(w.data_ptr() for w in norms), *(None if b is None else b.data_ptr() for b in blocks))
        self.eps = float(layer.input_layernorm.eps)
        self.heads, self.kv_heads, self.head_dim = att.num_heads, att.num_kv_heads, att.head_dim
        self.intermediate = mlp.gate_proj.out_features

    def __deepcopy__(self, memo):  # a copied layer has copied tensors: it builds its own plan
        return None

    def __reduce__(self):  # pickled / copied modules carry no plan (and ctypes pointers do not pickle)
        return (type(None), ())


def _projections(layer: torch.nn.Module) -> tuple[torch.nn.Module, ...]:
    att, mlp = layer.self_attn, layer.mlp
    return att.q_proj, att.k_proj, att.v_proj, att.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj


def _plan_kind(layer: torch.nn.Module) -> tuple[str, int] | None:
    """("f32", 0) for a layer of fp32 model.Linear projections and fp32 norms, ("bf16", 0) for bf16 ones (a bf16
    model), ("i4", group size) for Int4Linear projections (one group size, kernel-ready buffers) with fp32 norms;
    None for anything else, and for a layer with a feature or weight kind LAYER_SUPPORT does not declare."""
    if LAYER_SUPPORT.missing(layer):
        return None
    kind = _weight_kind(layer)
    return kind if kind is not None and kind[0] in LAYER_SUPPORT.weights else None


def _weight_kind(layer: torch.nn.Module) -> tuple[str, int] | None:
    from polyspec.decode.int4 import Int4Linear

    lins = _projections(layer)
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    attn = layer.self_attn
    if attn.q_proj.in_features != attn.o_proj.out_features:
        return None  # the kernel's attention reads the residual width (an EAGLE-3 layer reads 2H)
    if layer.self_attn.head_dim % 2 or layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return None
    dtype = norms[0].dtype
    if dtype not in (torch.float32, torch.bfloat16) or not all(t.dtype == dtype and t.is_cpu for t in norms):
        return None
    if all(type(lin).forward is _linear_forward for lin in lins):
        tensors = [lin.weight for lin in lins] + [lin.bias for lin in lins if lin.bias is not None]
        ok = all(t.dtype == dtype and t.is_cpu and t.is_contiguous() for t in tensors)
        return ("f32" if dtype == torch.float32 else "bf16", 0) if ok else None
    if dtype == torch.float32 and all(isinstance(lin, Int4Linear) for lin in lins):
        sizes = {lin.group_size for lin in lins}
        if len(sizes) == 1 and all(int4_layer_ok(lin) for lin in lins):
            return "i4", sizes.pop()
    return None


def layer_plan(layer: torch.nn.Module) -> LayerPlan | None:
    """The layer's cached :class:`LayerPlan`, built on first use; None when the layer is not one the kernel runs
    (a feature LAYER_SUPPORT does not declare, other dtypes, mixed projection kinds, int4 shapes the kernel does not
    take, ...)."""
    plan = layer.__dict__.get("_cpu_plan")
    if plan and any(w._version != v for w, v in plan.versions):  # a weight changed in place: its blocks are stale
        plan = None
    if plan is None:
        kind = _plan_kind(layer)
        plan = False if kind is None else LayerPlan(layer, *kind)
        layer.__dict__["_cpu_plan"] = plan
    if plan and plan.kind == "i4" and _int4_reference():
        return None
    return plan or None


def drop_plans(module: torch.nn.Module) -> None:
    """Forget every cached LayerPlan under ``module``."""
    for sub in module.modules():
        sub.__dict__.pop("_cpu_plan", None)


def block_supported(x: torch.Tensor, cos: torch.Tensor, cache, mask: torch.Tensor | None,
                    max_rows: int = MAX_ROWS) -> bool:
    """Whether a block of layers may run through :func:`run_layers` (each layer also needs a plan of its dtype): input
    [1, T, H] of a LAYER_SUPPORT dtype on the CPU, T at most ``max_rows`` (:func:`rows_limit`) and LAYER_SUPPORT's
    widest, a batch-1 KV cache of the same dtype, a bool mask or none, no autograd, no tracer or compiler, the
    library loaded."""
    if not x.is_cpu or x.dim() != 3 or x.shape[0] != 1 or (mask is not None and mask.dtype != torch.bool):
        return False
    return _block_ok(x.dtype, x.shape[1], cache, max_rows)


def _block_ok(dtype: torch.dtype, t: int, cache, max_rows: int) -> bool:
    """block_supported for a block of ``t`` rows of ``dtype`` on the CPU without a mask."""
    if not _ready() or cache is None or dtype not in LAYER_SUPPORT.activations \
            or not 0 < t <= min(max_rows, LAYER_SUPPORT.max_rows):
        return False
    if cache.batch_size != 1 or cache.k[0].dtype != dtype or not cache.k[0].is_cpu:
        return False
    if torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling():
        return False
    return _load() is not None


def _layer_call(plan: LayerPlan, x: torch.Tensor) -> tuple[object, tuple]:
    """The kernel entry point for a plan and an input dtype, and the arguments that go before the shared ones;
    ValueError when plan and dtype do not go together."""
    if plan.kind == "bf16" and x.dtype == torch.bfloat16:
        return _lib.polyspec_layer_bf16, (plan.ptrs,)
    if plan.kind == "f32" and x.dtype == torch.float32:
        return _lib.polyspec_layer_f32, (plan.ptrs,)
    if plan.kind == "i4" and x.dtype == torch.float32:
        return _lib.polyspec_layer_i4, (plan.ptrs, plan.group_size)
    raise ValueError(f"a {plan.kind} layer plan cannot run a {x.dtype} block")


def run_layers(plans: list[LayerPlan], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               mask: torch.Tensor | None, cache, start: int, first: int = 0) -> torch.Tensor:
    """Layers first .. first + len(plans) - 1 of a block (model.DecoderLayer.forward each), one kernel call per layer
    on one residual buffer (the caller checked :func:`block_supported` and has every layer's plan); writes each
    layer's K/V for positions start .. start + T - 1 into the cache. The residual stream is fp32 inside the block; a
    bf16 block's input is widened once and its output rounded once."""
    out = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous().clone()
    t, h = out.shape[1], out.shape[2]
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    m = None if mask is None else mask.contiguous()
    o, cp, sp, mp = out.data_ptr(), cos.data_ptr(), sin.data_ptr(), None if m is None else m.data_ptr()
    threads = torch.get_num_threads()
    for i, plan in enumerate(plans, start=first):
        k, v = cache.k[i], cache.v[i]
        fn, lead = _layer_call(plan, x)
        rc = fn(o, *lead, plan.eps, t, h, plan.heads, plan.kv_heads, plan.head_dim, plan.intermediate, cp, sp,
                k.data_ptr(), v.data_ptr(), k.shape[2], start, mp, threads)
        if rc != 0:
            raise ValueError(f"run_layers: the kernel refused the shapes of layer {i} (code {rc})")
    return out if x.dtype == torch.float32 else out.to(x.dtype)


_KINDS = {"bf16": 0, "f32": 1, "i4": 2}  # polyspec_layers' kind codes


class LayerBlock:
    """What :func:`run_block` needs to run a model's layers over a causal block in one kernel call: the layers'
    plans (their pointer tables in one array), the caches' per-layer pointers, and the RoPE table [2, S, D] for the
    cache's S positions (fp32 of the values ``rope_cos_sin`` gives in the compute dtype). Built by
    :func:`layer_block`, which checks on every use (once per :func:`weights_frozen` span) that each plan is still its
    layer's and no watched weight changed in place (the checks :func:`layer_plan` makes per layer)."""

    __slots__ = ("plans", "code", "group_size", "eps", "sizes", "ptrs", "kc", "vc", "rope", "watched", "versions",
                 "checked")

    def __init__(self, plans: list[LayerPlan], cache, rope: torch.Tensor):
        first = plans[0]
        self.plans = plans
        self.code, self.group_size, self.eps = _KINDS[first.kind], first.group_size, first.eps
        self.sizes = (first.heads, first.kv_heads, first.head_dim, first.intermediate)
        self.ptrs = (ctypes.c_void_p * len(plans))(*(ctypes.addressof(p.ptrs) for p in plans))
        self.kc = (ctypes.c_void_p * len(plans))(*(k.data_ptr() for k in cache.k[:len(plans)]))
        self.vc = (ctypes.c_void_p * len(plans))(*(v.data_ptr() for v in cache.v[:len(plans)]))
        self.rope = rope
        pairs = [pair for p in plans for pair in p.versions]
        self.watched, self.versions = [t for t, _ in pairs], [v for _, v in pairs]
        self.checked = 0  # the weights_frozen span it was last found current in

    def __deepcopy__(self, memo):  # a copied cache has its own memory: it builds its own blocks
        return None

    def __reduce__(self):  # ctypes pointers do not pickle
        return (type(None), ())


def layer_block(layers: list[torch.nn.Module], cache, dtype: torch.dtype, t: int, inv_freq: torch.Tensor,
                max_rows: int) -> LayerBlock | None:
    """The :class:`LayerBlock` of ``layers`` over ``cache`` (a model.StaticKVCache; kept in its ``layer_blocks``)
    for a causal block of ``t`` rows of ``dtype``, or None where one call does not apply: a block
    :func:`block_supported` refuses (more than ``max_rows`` rows, ...), a layer without a plan, plans of different
    kinds or shapes, a kind that does not take the dtype, int4 reference mode."""
    blocks = getattr(cache, "layer_blocks", None)
    if blocks is None or not _block_ok(dtype, t, cache, max_rows) or _int4_reference():
        return None
    k0 = cache.k[0]
    key = (id(layers[0]), len(layers), k0.data_ptr(), cache.v[0].data_ptr(), dtype)
    block, scope = blocks.get(key), getattr(_frozen, "scope", 0)
    if block is not None and (scope and block.checked == scope or _block_current(block, layers)):
        block.checked = scope
        return block
    blocks.pop(key, None)
    plans = [layer_plan(layer) for layer in layers]
    if any(p is None for p in plans) or len({(p.kind, p.group_size, p.eps, p.heads, p.kv_heads, p.head_dim,
                                              p.intermediate) for p in plans}) != 1:
        return None
    if dtype != (torch.bfloat16 if plans[0].kind == "bf16" else torch.float32):
        return None
    from polyspec.decode.model import rope_cos_sin

    cos, sin = rope_cos_sin(inv_freq.cpu(), torch.arange(k0.shape[2]), dtype)
    block = blocks[key] = LayerBlock(plans, cache, torch.stack((cos, sin)).float().contiguous())
    block.checked = scope
    return block


def _block_current(block: LayerBlock, layers: list[torch.nn.Module]) -> bool:
    """Whether each of ``block``'s plans is still its layer's and no watched weight changed in place since."""
    return all(layer.__dict__.get("_cpu_plan") is p for layer, p in zip(layers, block.plans, strict=True)) \
        and [t._version for t in block.watched] == block.versions


def _tree_args(t: int, positions: list[int] | None, tree_mask: torch.Tensor | None) -> tuple:
    """polyspec_layers' (positions, tree, W) for a block of ``t`` rows: absolute RoPE positions (default start ..
    start + t - 1) and a draft tree's bool mask [t, W] over the block's last W positions (default causal; the
    kernel checks W and the diagonal). The mask comes back too: the caller keeps it alive through the call."""
    pos = None if positions is None else (ctypes.c_int64 * t)(*positions)
    if tree_mask is None:
        return pos, None, 0, None
    m = tree_mask.to(torch.bool).contiguous()
    if m.dim() != 2 or m.shape[0] != t:
        raise PolyspecError(f"a tree's mask must be [T, W] with T = {t} rows, got {list(m.shape)}")
    return pos, m.data_ptr(), m.shape[1], m


def run_block(block: LayerBlock, x: torch.Tensor, cache, start: int, positions: list[int] | None = None,
              tree_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`run_layers` over a block at cache position ``start`` in one kernel call (the same layers' arithmetic,
    so bitwise its result): x [1, T, H] -> the block's output, same dtype; writes the layers' K/V. Causal, or a
    draft tree's rows at ``positions`` under ``tree_mask`` (:func:`_tree_args`)."""
    out = x.float().contiguous() if x.dtype != torch.float32 else x.contiguous().clone()
    t, h = out.shape[1], out.shape[2]
    pos, mp, w, _keep = _tree_args(t, positions, tree_mask)
    rc = _lib.polyspec_layers(block.code, block.group_size, out.data_ptr(), block.ptrs, len(block.plans), block.eps,
                              t, h, *block.sizes, block.rope.data_ptr(), block.kc, block.vc, cache.k[0].shape[2],
                              start, pos, mp, w, torch.get_num_threads())
    if rc != 0:
        raise _block_error("run_block", rc)
    return out if x.dtype == torch.float32 else out.to(x.dtype)


def _block_error(where: str, rc: int) -> Exception:
    """The error for a refusal of polyspec_layers (2: the start, or a tree's mask; 4: a position; 16 l + code: layer
    l's shapes)."""
    if rc == 2:
        return PolyspecError(f"{where}: a tree's mask must be [T, W] with T <= W <= the cache's positions after the "
                             "block, and let every token see itself (its diagonal must be all True)")
    if rc == 4:
        return PolyspecError(f"{where}: a position lies outside the cache (its RoPE table)")
    return ValueError(f"{where}: the kernel refused the shapes of layer {rc // 16} (code {rc % 16})")


def final_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor | None:
    """A bf16 model's final RMSNorm on the kernel (cpu_kernels.cpp, final_norm_bf16) for x [..., H] bf16 on the CPU
    without autograd, or None (the module's own forward then runs). Transformer._out takes it whenever it applies,
    so every forward of a model normalises alike: in one call (:func:`run_forward`) or not, a verification's rows
    get a decode step's hidden states and logits."""
    w = norm.weight
    if not (_ready() and x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.is_cpu and w.is_cpu) \
            or x.shape[-1] != w.shape[0] or torch.is_grad_enabled() or torch.jit.is_tracing() \
            or torch.compiler.is_compiling() or _load() is None:
        return None
    xc = x.contiguous()
    y = torch.empty(xc.shape, dtype=torch.bfloat16)
    _lib.polyspec_final_norm_bf16(xc.data_ptr(), _norm_weight(norm).data_ptr(), float(norm.eps),
                                  xc.numel() // w.shape[0], w.shape[0], y.data_ptr())
    return y


def _norm_weight(norm: torch.nn.Module) -> torch.Tensor:
    """The norm's bf16 weight as fp32 (cached on the module while its data and version stay)."""
    w = norm.weight
    key = (w.data_ptr(), version(w))
    cached = norm.__dict__.get("_kernel_weight")
    if cached is None or cached[0] != key:
        cached = norm.__dict__["_kernel_weight"] = (key, w.detach().float().contiguous())
    return cached[1]


def _token_ids_error(ids: list[int], rows: int) -> PolyspecError:
    """The one error for token ids the one-call kernels refused (code 5: a row outside the embedding's ``rows``)."""
    return PolyspecError(f"token ids must lie in 0..{rows - 1} (the embedding's rows), got {ids}")


class ForwardArgs:
    """:func:`run_forward`'s arguments that stay put while the weights and the cache do (a model keeps them through
    a :func:`weights_frozen` span: one generation): the embedding, the layer block, the final norm and the lm_head,
    as the kernel's argument groups. Building them reads ~15 tensor attributes, each tens of microseconds after a
    forward's weight stream has left their code cold."""

    __slots__ = ("plans", "embed", "model", "head", "vocab", "hidden_size", "_keep")

    def __init__(self, block: LayerBlock, embed: torch.Tensor, norm: torch.nn.Module, lm_weight: torch.Tensor,
                 cache) -> None:
        (self.vocab, self.hidden_size), nw = lm_weight.shape, _norm_weight(norm)
        self.plans = block.plans
        self.embed = (embed.data_ptr(), embed.shape[0])
        self.model = (self.hidden_size, block.ptrs, len(block.plans), block.eps, *block.sizes, block.rope.data_ptr(),
                      block.kc, block.vc, cache.k[0].shape[2])
        self.head = (nw.data_ptr(), float(norm.eps), lm_weight.data_ptr(), blocks_ptr(lm_weight), self.vocab)
        self._keep = (block, embed, nw, lm_weight)  # the pointers above stay valid while these live


def run_forward(args: ForwardArgs, ids: list[int], start: int, first: int, positions: list[int] | None = None,
                tree_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 model's forward over a block in one kernel call (cpu_kernels.cpp's forward_bf16): T token ids at cache
    position ``start`` (causal, or a draft tree's rows at ``positions`` under ``tree_mask``: :func:`_tree_args`) ->
    (logits [T - first, V] fp32 of rows first .. T - 1, final-norm'd hidden [T, H] bf16), bitwise what
    :func:`run_block`, :func:`final_norm` and :func:`kernel_linear` give one after another. The caller checked the
    weights (bf16, CPU, contiguous; an lm_head without bias) and made ``args`` from :func:`layer_block`'s block."""
    t = len(ids)
    hidden = torch.empty((t, args.hidden_size), dtype=torch.bfloat16)
    logits = torch.empty((t - first, args.vocab), dtype=torch.float32)
    pos, mp, w, _keep = _tree_args(t, positions, tree_mask)
    rc = _lib.polyspec_forward_bf16((ctypes.c_int64 * t)(*ids), *args.embed, t, *args.model, start, pos, mp, w,
                                    *args.head, first, hidden.data_ptr(), logits.data_ptr(), torch.get_num_threads())
    if rc == 5:
        raise _token_ids_error(ids, args.embed[1])
    if rc == 3:
        raise ValueError(f"run_forward: logits from row {first} of a block of {t}")
    if rc != 0:
        raise _block_error("run_forward", rc)
    return logits, hidden


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """softmax(q k^T / sqrt(D), masked) v through the layer kernel's attention (model.attend's contract: q [1, h, T, D],
    k/v [1, kv, L, D] views of a KV cache or tensors of their own, mask bool [T, L] or None), or None where it does not
    apply: other dtypes or layouts, autograd, a tracer or compiler. A prompt's attention then costs a third of torch's
    fused CPU attention (docs/KERNELS.md) and each row's result is the one a decode step computes."""
    if not (_ready() and q.is_cpu and q.dim() == 4 and q.shape[0] == 1 and k.dim() == 4 and k.shape[0] == 1):
        return None
    dtype, (_, h, t, d), kv, n = q.dtype, q.shape, k.shape[1], k.shape[2]
    if dtype not in (torch.float32, torch.bfloat16) or k.dtype != dtype or v.dtype != dtype or h % kv or d % 2:
        return None
    if k.stride()[2:] != (d, 1) or v.stride() != k.stride() or k.stride(1) < n * d or v.shape != k.shape:
        return None
    if mask is not None and (mask.dtype != torch.bool or mask.shape[-2:] != (t, n) or mask.numel() != t * n):
        return None
    if torch.is_grad_enabled() or torch.jit.is_tracing() or torch.compiler.is_compiling() or _load() is None:
        return None
    q32 = q[0].transpose(0, 1).reshape(t, h * d).float().contiguous()  # [T, h D]
    m = None if mask is None else mask.reshape(t, n).contiguous()
    out = torch.empty((t, h * d), dtype=torch.float32)
    fn = _lib.polyspec_attention_bf16 if dtype == torch.bfloat16 else _lib.polyspec_attention_f32
    rc = fn(q32.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(1) // d, n, t, h, kv, d,
            None if m is None else m.data_ptr(), torch.get_num_threads(), out.data_ptr())
    if rc != 0:
        return None
    return out.view(t, h, d).transpose(0, 1)[None].to(dtype)


@dataclass(frozen=True)
class HeadStep:
    """The bf16 tensors of an EAGLE head's decode step that :func:`head_step` reads (decode/head.py builds it):
    the target's embedding [V, H], fc [H, 2H] and its bias as fp32, the layer's plan, the lm rows [Vd, H], and the
    RoPE table [2, S, D] (cos, sin per position, fp32 of the bf16 values the module path computes); fc's and the lm
    rows' 16-row blocks where they have them (:func:`blocks_of`: the module path then reads them too); with a draft
    vocabulary, its token ids [Vd] (int64: the lm rows' tokens) and the full vocabulary's size."""

    embed: torch.Tensor
    fc_weight: torch.Tensor
    fc_bias: torch.Tensor
    plan: LayerPlan
    lm_weight: torch.Tensor
    rope: torch.Tensor
    fc_blocks: torch.Tensor | None = None
    lm_blocks: torch.Tensor | None = None
    vocab_ids: torch.Tensor | None = None
    vocab_size: int = 0

    def __post_init__(self) -> None:  # the kernel's argument groups, read once (each read is cold in decoding)
        p, blocks = self.plan, (self.fc_blocks, self.lm_blocks)
        groups = ((self.embed.data_ptr(), self.embed.shape[0]),
                  (self.fc_weight.data_ptr(), self.fc_bias.data_ptr(), ctypes.addressof(p.ptrs), p.eps, p.heads,
                   p.kv_heads, p.head_dim, p.intermediate, self.rope.data_ptr()),
                  (self.lm_weight.data_ptr(), self.lm_weight.shape[0],
                   None if self.vocab_ids is None else self.vocab_ids.data_ptr(), self.vocab_size),
                  tuple(None if b is None else b.data_ptr() for b in blocks),
                  self.lm_weight.shape[0] if self.vocab_ids is None else self.vocab_size)
        object.__setattr__(self, "groups", groups)


def head_step(step: HeadStep, ids: list[int], features: torch.Tensor, cache, start: int,
              out_rows: int, positions: torch.Tensor | None = None,
              mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """An EAGLE head's step in one kernel call (cpu_kernels.cpp's head_step_bf16): T token ids, features
    [T, H] bf16, the head's bf16 cache (positions start .. start + T - 1 written) -> (hidden [T, H] bf16, logits of
    the last ``out_rows`` rows [out_rows, V] fp32: over the lm rows, or with a draft vocabulary over every token, -inf
    outside it), bitwise what the module path gives. A draft tree's rows: ``positions`` [T] (int64, each below the
    rope table's length) and ``mask`` [T, start + T] bool (the model's block_mask); default: positions start..,
    causal within the block. The caller checked :func:`available`, the shapes and dtypes (decode/head.py,
    ``EagleHead._kernel_step``)."""
    t, h = features.shape
    embed, layer, lm, blocks, width = step.groups
    hidden = torch.empty((t, h), dtype=torch.bfloat16)
    logits = torch.empty((out_rows, width), dtype=torch.float32)
    k, v = cache.k[0], cache.v[0]
    rc = _lib.polyspec_head_step_bf16(
        (ctypes.c_int64 * t)(*ids), *embed, features.data_ptr(), t, h, *layer,
        None if positions is None else positions.data_ptr(), k.data_ptr(), v.data_ptr(), k.shape[2], start,
        None if mask is None else mask.data_ptr(), *lm, out_rows, hidden.data_ptr(), logits.data_ptr(),
        torch.get_num_threads(), *blocks)
    if rc == 5:
        raise _token_ids_error(ids, step.embed.shape[0])
    if rc != 0:
        raise ValueError(f"head_step: the kernel refused the shapes (code {rc})")
    return hidden, logits


# ---------------------------------------------------------------------------------------------------------------
# Weight arena: a loaded model's weights in one block of memory, in the order a decode step reads them
# ---------------------------------------------------------------------------------------------------------------

_arenas: set[tuple[int, int]] = set()  # (address, bytes) of the storages of the arenas made so far


def _in_arena(t: torch.Tensor) -> bool:
    """Whether t's storage is an arena (a view of one has the whole block as its storage; a freed arena's address
    can only be matched again by a storage of exactly its size at exactly its address: another arena)."""
    st = t.untyped_storage()
    return (st.data_ptr(), st.nbytes()) in _arenas


# bf16 weights' 16-row blocks (cpu_kernels.cpp, rows_nk16): a second copy of each packed bf16 matmul weight in the
# layout the widened rows read fastest, [ceil(N / 16), ceil(K / 2), 16] 32-bit words. Made by pack_weights where the
# build's bf16 rows are the widened ones (no AVX512-BF16) or bf16_rows chose them, recorded on the weight's Parameter.

_BLOCKS = "_polyspec_nk16"  # attribute on a weight: [blocks tensor, data_ptr, _version] at the time of packing


def _blocks_wanted() -> bool:
    """Blocks pay where the build widens bf16 weights (no AVX512-BF16) or bf16_rows chose them; POLYSPEC_ROW_BLOCKS=0
    saves their memory (a second copy of the bf16 weights) at the rows' speed."""
    if not _row_blocks_allowed() or not _enabled or _load() is None:
        return False
    return _lib.polyspec_dot_path() == 0 or bf16_rows() == "blocks"


def _row_blocks_allowed() -> bool:
    return _setting("POLYSPEC_ROW_BLOCKS", ("0", "1"), "1") == "1"


def _block_words(w: torch.Tensor) -> int:
    n, k = w.shape
    return (n + 15) // 16 * 16 * ((k + 1) // 2)


def _pack_blocks(w: torch.Tensor, out: torch.Tensor) -> None:
    _lib.polyspec_pack_nk16(w.data_ptr(), w.shape[0], w.shape[1], out.data_ptr())


def version(t: torch.Tensor) -> int | None:
    """t's in-place version counter; None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def blocks_of(w: torch.Tensor) -> torch.Tensor | None:
    """The 16-row blocks of bf16 weight ``w`` (a Parameter pack_weights gave them), repacked first when ``w`` was
    changed in place since; None when it has none or its data moved (``.to()``, a new ``.data``)."""
    rec = getattr(w, _BLOCKS, None)
    if rec is None or w.data_ptr() != rec[1] or w.dtype != torch.bfloat16 or not w.is_contiguous():
        return None
    if version(w) != rec[2]:
        _pack_blocks(w, rec[0])
        rec[2] = version(w)
    return rec[0]


def blocks_ptr(w: torch.Tensor) -> int | None:
    b = blocks_of(w)
    return None if b is None else b.data_ptr()


def _matmul_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The bf16 weights of ``model``'s plain Linear layers (the lm_head too, tied or not), decoder layers first, each
    once; not embeddings that no Linear reads."""
    seen: set[int] = set()
    out = []
    for mod in model.modules():
        w = getattr(mod, "weight", None)
        if type(mod).forward is _linear_forward and isinstance(w, torch.Tensor) and w.dim() == 2 \
                and w.dtype == torch.bfloat16 and w.is_cpu and id(w) not in seen:
            seen.add(id(w))
            out.append(w)
    return out


def make_blocks(weights: list[torch.Tensor], force: bool = False) -> int:
    """Give each contiguous 2-D bf16 CPU weight without them its 16-row blocks, in one huge-page block of memory in
    this order (a step reads them in that order); returns the bytes. 0 where blocks do not pay (_blocks_wanted) unless
    ``force`` (the library loaded: fp32 inputs against bf16 weights take them on every build)."""
    weights = [w for w in weights if blocks_of(w) is None and w.dim() == 2 and w.dtype == torch.bfloat16
               and w.is_cpu and w.is_contiguous()]
    if not weights or not (_blocks_wanted() or (force and _enabled and _load() is not None)):
        return 0
    words = [(_block_words(w) + 15) // 16 * 16 for w in weights]  # 64-byte aligned
    arena = _anonymous_block(4 * sum(words)).view(torch.int32)
    off = 0
    for w, n in zip(weights, words, strict=True):
        out = arena[off:off + _block_words(w)]
        _pack_blocks(w, out)
        setattr(w, _BLOCKS, [out, w.data_ptr(), version(w)])
        off += n
    return 4 * off


# Int4 weights' 16-row blocks against int8 inputs (cpu_kernels.cpp, rows_qv: W4A8 on AVX512-VNNI's vpdpbusd), a
# second copy of each Int4Linear's codes with its scales and z s, made by pack_weights for a level below the target
# where the build has VNNI, recorded on the module. The levels above check its every token, so rounding its inputs to
# int8 leaves a chain exact.

_I4_BLOCKS = "_polyspec_i4v"  # in an Int4Linear's __dict__: [blocks, qdata's data_ptr, the 3 buffers' versions]


def _i4_blocks_wanted() -> bool:
    """Where the build has AVX512-VNNI; POLYSPEC_INT4_A8=0 keeps the int4 rows on fp32 inputs (W4A16) instead."""
    if _setting("POLYSPEC_INT4_A8", ("0", "1"), "1") == "0":
        return False
    return _enabled and _load() is not None and _lib.polyspec_i4_vnni() == 1


def _qv_words(n: int, k: int, group_size: int, bits: int) -> int:
    """32-bit words of an [n, k] weight's int8-input blocks (cpu_kernels.cpp, qv_block_words): per 16 rows, the
    codes, then s and z s per group."""
    return (n + 15) // 16 * 16 * (k * bits // 32 + 2 * ((k + group_size - 1) // group_size))


def _i4_versions(mod: torch.nn.Module) -> tuple:
    return tuple(version(t) for t in (mod.qdata, mod.scales, mod.zeros))


def _pack_i4(mod: torch.nn.Module, out: torch.Tensor) -> None:
    _lib.polyspec_pack_i4v(mod.qdata.data_ptr(), mod.scales.data_ptr(), mod.zeros.data_ptr(), mod.out_features,
                           mod.in_features, mod.group_size, out.data_ptr())


def i4_blocks_of(mod: torch.nn.Module) -> torch.Tensor | None:
    """The int8-input blocks of Int4Linear ``mod`` (made by :func:`make_i4_blocks`), repacked first when its buffers
    were changed in place since; None when it has none or its codes moved."""
    rec = mod.__dict__.get(_I4_BLOCKS)
    if rec is None or mod.qdata.data_ptr() != rec[1]:
        return None
    if _i4_versions(mod) != rec[2]:
        _pack_i4(mod, rec[0])
        rec[2] = _i4_versions(mod)
    return rec[0]


def make_i4_blocks(mods: list[torch.nn.Module]) -> int:
    """Give each kernel-ready Int4Linear without them its int8-input blocks, in one huge-page block of memory in this
    order; returns the bytes (0 where they are not wanted: :func:`_i4_blocks_wanted`)."""
    mods = [m for m in mods if i4_blocks_of(m) is None and int4_layer_ok(m)]
    if not mods or not _i4_blocks_wanted():
        return 0
    sizes = [_qv_words(m.out_features, m.in_features, m.group_size, 4) for m in mods]
    words = [(n + 15) // 16 * 16 for n in sizes]  # 64-byte aligned
    arena = _anonymous_block(4 * sum(words)).view(torch.int32)
    off = 0
    for m, size, n in zip(mods, sizes, words, strict=True):
        out = arena[off:off + size]
        _pack_i4(m, out)
        m.__dict__[_I4_BLOCKS] = [out, m.qdata.data_ptr(), _i4_versions(m)]
        off += n
    return 4 * off


# An int4 level's lm_head: a W4A16 checkpoint keeps it 16-bit (SmolLM2's tied 49,152 x 576 one is half the int4
# level's bytes), so where the int4 layers take their int8-input blocks it gets 8-bit codes (RTN, groups of 128) in
# the same blocks (rows_qv<8>): half the bytes, a quarter of the multiply instructions.

_Q8 = "_polyspec_q8v"  # on the lm_head weight: [blocks, data_ptr, version]
_Q8_GROUP = 128


def _make_q8(w: torch.Tensor, out: torch.Tensor) -> None:
    from polyspec.decode.int4 import quantize_rtn

    q, s, z = quantize_rtn(w, _Q8_GROUP, sym=False, bits=8)
    _lib.polyspec_pack_q8v(q.contiguous().data_ptr(), s.data_ptr(), z.data_ptr(), w.shape[0], w.shape[1], _Q8_GROUP,
                           out.data_ptr())


def q8_lm_head_of(w: torch.Tensor) -> torch.Tensor | None:
    """The 8-bit blocks of lm_head weight ``w`` (:func:`make_q8_lm_head`), remade first when ``w`` was changed in
    place since; None when it has none or its data moved."""
    rec = getattr(w, _Q8, None)
    if rec is None or w.data_ptr() != rec[1]:
        return None
    if version(w) != rec[2]:
        _make_q8(w, rec[0])
        rec[2] = version(w)
    return rec[0]


def make_q8_lm_head(model: torch.nn.Module) -> int:
    """Give an int4 level's lm_head (``model.lm_head``, a plain Linear) 8-bit codes in int8-input blocks where its
    int4 layers have theirs (the same switch, POLYSPEC_INT4_A8); returns the bytes."""
    head = getattr(model, "lm_head", None)
    w = getattr(head, "weight", None)
    if type(head).forward is not _linear_forward or not isinstance(w, torch.Tensor) or w.dim() != 2 \
            or not w.is_cpu or w.shape[1] % 4 or getattr(w, _Q8, None) is not None or not _i4_blocks_wanted():
        return 0
    words = _qv_words(*w.shape, _Q8_GROUP, 8)
    out = _anonymous_block(4 * words).view(torch.int32)[:words]
    _make_q8(w, out)
    setattr(w, _Q8, [out, w.data_ptr(), version(w)])
    return 4 * words


def _q8_linear(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    xf = x.contiguous()
    k = x.shape[-1]
    b = None if bias is None else bias.float().contiguous()
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    rc = _lib.polyspec_linear_q8v(xf.data_ptr(), blocks.data_ptr(), None if b is None else b.data_ptr(), n,
                                  xf.numel() // k, k, _Q8_GROUP, y.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"polyspec_linear_q8v refused K = {k} (code {rc})")
    return y


def _anonymous_block(nbytes: int) -> torch.Tensor:
    """A uint8 tensor over fresh anonymous memory of at least ``nbytes`` (huge pages where the kernel grants them)."""
    size = max(1, (nbytes + (2 << 20) - 1) // (2 << 20)) * (2 << 20)
    block = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            block.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    return torch.frombuffer(block, dtype=torch.uint8)  # keeps the block alive as long as any view of it


def pack_weights(model: torch.nn.Module, int8_inputs: bool = False) -> int:
    """Move ``model``'s CPU parameters and buffers into one anonymous memory block (huge pages where the kernel
    grants them), the decoder layers first in module order, then the rest (embedding / lm_head, norms), so a decode
    step reads one ascending stream of memory. Tensors already in an arena (a head sharing its target's lm_head) stay
    where they are. Values, shapes, dtypes, parameter identity and sharing are unchanged (each ``.data`` becomes a
    view of the block). Returns the bytes moved; 0 when the fast path is off or nothing is on the CPU. Where the
    build widens bf16 weights or takes them on vdpbf16ps (:func:`bf16_rows`), each bf16 Linear weight also gets its
    16-row blocks (:func:`make_blocks`: the same bytes again, POLYSPEC_ROW_BLOCKS=0 to go without). ``int8_inputs``:
    the model is a level below the target, whose every token the levels above check, so where the build has
    AVX512-VNNI its Int4Linear layers get int8-input blocks and its lm_head 8-bit codes (:func:`make_i4_blocks`,
    :func:`make_q8_lm_head`; POLYSPEC_INT4_A8=0 to go without). A target never does: its distribution is the one a
    chain reproduces.

    For models loaded to decode (``load_chain``): a packed tensor's storage is the whole block, so save weights
    from the original files, not from a packed model.
    """
    if not _enabled:
        return 0
    layers = getattr(model, "layers", None)
    first = list(layers) if layers is not None else []
    seen: set[int] = set()
    items: list[torch.Tensor] = []
    for mod in [*first, model]:
        for t in [*mod.parameters(), *mod.buffers()]:
            if id(t) in seen or t.device.type != "cpu" or t.numel() == 0 or _in_arena(t):
                continue
            seen.add(id(t))
            items.append(t)
    if not items:
        return 0
    offsets, total = [], 0
    for t in items:
        offsets.append(total)
        total += (t.numel() * t.element_size() + 63) // 64 * 64
    arena = _anonymous_block(total)
    for t, off in zip(items, offsets, strict=True):
        view = arena[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t.detach())
        t.data = view
    _arenas.add((arena.untyped_storage().data_ptr(), arena.untyped_storage().nbytes()))
    drop_plans(model)
    for mod in model.modules():  # projections fused into one weight (model.fuse_projections) are separate again
        mod.__dict__.pop("_fused", None)
    from polyspec.decode.int4 import Int4Linear

    if int8_inputs and make_i4_blocks([m for m in model.modules() if isinstance(m, Int4Linear)]):
        make_q8_lm_head(model)  # then its 16-bit copy needs no 16-row blocks
    make_blocks([w for w in _matmul_weights(model) if q8_lm_head_of(w) is None])
    return total
