#!/usr/bin/env bash
# make gpu-prep-check: the GPU check's preparation (make gpu-prep) checked end to end on this machine, as far as
# it can be without the device: a stand-in of the device machine (a clean venv of GPU_CHECK_PYTHON, default
# python3.12, holding only packages of the device's list, lab/gpu/device_packages.txt), then the GPU check's install
# lines (lab/gpu/install.sh) with pip's index and config switched off, in a copy of the tree as it travels, then
# the GPU check's steps that run there without CUDA. Exits non-zero at the first failure.
#
# The stand-in's own packages come from the ordinary index once (GPU_CHECK_DIR/base-VERSION, reused); all after that
# runs with PIP_NO_INDEX=1. torch joins the stand-in only when GPU_CHECK_TORCH names it (a requirement or a wheel file
# for this Python; the device's own is CUDA torch 2.11 for 3.12): without it the torch-bound checks are reported as
# not run. With a Python other than 3.12 (GPU_CHECK_PYTHON=python3.11, as a stand-in where 3.12 has no torch wheel)
# the carried wheels are fetched again for that Python, at the same versions as .whl's, and that is said.
set -euo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
PY=${GPU_CHECK_PYTHON:-python3.12}
WORK=$(realpath -m "${GPU_CHECK_DIR:-.cache/gpu-prep-check}")
command -v "$PY" >/dev/null || { echo "check_gpu_prep: no $PY on PATH; set GPU_CHECK_PYTHON to a CPython 3.12" >&2; exit 2; }
ls .whl/*.whl >/dev/null 2>&1 || { echo "check_gpu_prep: no .whl/*.whl here; run make gpu-prep first" >&2; exit 2; }
say() { echo "check_gpu_prep: $*" >&2; }

mkdir -p "$WORK"
rm -rf "$WORK/venv" "$WORK/tree" "$WORK/site"
"$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
VER=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
BASE=$WORK/base-$VER
# -- the device stand-in: what the GPU check imports from the device's own packages, at the versions seen there (numpy
# 2.5 has no 3.11 wheel: any numpy for the 3.11 stand-in) --
NUMPY=numpy==2.5.2
[ "$VER" = 3.12 ] || NUMPY=numpy
BASE_PKGS="${GPU_CHECK_TORCH:-} setuptools wheel packaging pyyaml rich $NUMPY safetensors==0.8.0 tokenizers==0.23.2
  huggingface-hub==1.33.0 transformers==5.17.0 filelock fsspec pandas pyarrow requests tqdm xxhash aiohttp pytest
  jinja2 psutil"
# with torch, what the test modules and the train / export stages import from the device's packages too
[ -z "${GPU_CHECK_TORCH:-}" ] || BASE_PKGS="$BASE_PKGS lightning accelerate onnx onnxscript onnxruntime matplotlib"
say "stand-in: Python $("$VPY" -c 'import sys; print(sys.version.split()[0])') in a clean venv ($WORK/venv)"
if [ "$(cat "$BASE/.complete" 2>/dev/null)" != "$BASE_PKGS" ]; then
    rm -rf "$BASE" && mkdir -p "$BASE"
    # shellcheck disable=SC2086
    nice -n 19 "$VPY" -m pip download -q --only-binary=:all: -d "$BASE" $BASE_PKGS
    echo "$BASE_PKGS" > "$BASE/.complete"
fi
export PIP_NO_INDEX=1 PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
# shellcheck disable=SC2086
nice -n 19 "$VPY" -m pip install -q --no-index --find-links "$BASE" $BASE_PKGS
# what the pinned packages pulled in beyond the device's list leaves the stand-in again: the device lacks it too
EXTRA=$("$VPY" -I - "$REPO/lab/gpu/device_packages.txt" <<'EOF'
import importlib.metadata as md, re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n.strip()).lower()
listed = {norm(l) for l in open(sys.argv[1]) if l.strip() and not l.startswith("#")}
print(" ".join(sorted({norm(d.metadata["Name"]) for d in md.distributions()} - listed)))
EOF
)
if [ -n "$EXTRA" ]; then
    say "not on the device's list, so out of the stand-in: $EXTRA"
    # shellcheck disable=SC2086
    "$VPY" -m pip uninstall -q -y $EXTRA
fi

# -- the tree as a device call gets it (tracked and untracked-not-ignored files) plus the carried .whl --
mkdir -p "$WORK/tree"
git ls-files -co --exclude-standard -z | tar --null -T - -cf - | tar -xf - -C "$WORK/tree"
if [ "$VER" = 3.12 ]; then
    cp -r .whl "$WORK/tree/.whl"
else
    say "Python $VER, not the device's 3.12: the carried wheels fetched again for $VER at .whl's versions (a stand-in)"
    PINS=$(ls .whl | sed -E 's/^([^-]+)-([^-]+)-.*/\1==\2/')
    # shellcheck disable=SC2086
    env -u PIP_NO_INDEX -u PIP_CONFIG_FILE nice -n 19 "$VPY" -m pip download -q --no-deps --only-binary=:all: -d "$WORK/tree/.whl" $PINS
fi
cd "$WORK/tree"
export PATH="$WORK/venv/bin:$PATH" GPU_SITE="$WORK/site"
unset PYTHONPATH
say "the install lines (lab/gpu/install.sh), no index"
# shellcheck disable=SC1091
. lab/gpu/install.sh
say "installed: $(ls .whl | tr '\n' ' ')"

run() { say "\$ $*"; "$@"; }
run polyspec --help >/dev/null
run polyspec run --help >/dev/null
run polyspec shape-bench llama2-7b --help >/dev/null
run python lab/gpu/probe.py --help >/dev/null
run python3 -c 'import pydantic, gguf, transformers
import polyspec.config, polyspec.manifest, polyspec.chain_spec, polyspec.sources, polyspec.pipeline
print("imports ok: pydantic", pydantic.VERSION, "gguf", gguf.__name__)'
run polyspec validate recipes/smollm2_chain.yaml tracking.enabled=false quantize.method=rtn quantize.devices=cuda >/dev/null
python3 - <<'EOF'
import re
import runpy
from pathlib import Path

wheel_requirements = runpy.run_path("lab/gpu/probe.py")["wheel_requirements"]
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
listed = {norm(l.strip()) for l in open("lab/gpu/device_packages.txt") if l.strip() and not l.startswith("#")}
unmet, device_only = {}, set()
for wheel, reqs in wheel_requirements(Path(".whl")).items():
    for r in reqs:  # a requirement on the device's list the stand-in lacks (torch, triton): the device's own
        name = norm(re.split(r"[<>=!~ ;\[(]", r)[0])
        (device_only.add(f"{wheel}: {r}") if r.endswith("(missing)") and name in listed
         else unmet.setdefault(wheel, []).append(r))
if unmet:
    raise SystemExit(f"check_gpu_prep: carried wheels with unmet requirements: {unmet}")
print("check_gpu_prep: every requirement of every carried wheel is met in the stand-in"
      + (f"; left to the device's own packages: {sorted(device_only)}" if device_only else ""))
EOF
if python3 -c 'import torch' 2>/dev/null; then  # both calls' steps at tiny shapes on the CPU, as make gpu-check-dry
    run env GPU_CHECK_DRY=1 OUT="$WORK/dry/call1" bash lab/gpu/check.sh 1
    run env GPU_CHECK_DRY=1 OUT="$WORK/dry/call2" bash lab/gpu/check.sh 2
else
    say "NOT RUN (no torch in the $VER stand-in; see GPU_CHECK_TORCH): the dry run of lab/gpu/check.sh"
fi
say "passed"
