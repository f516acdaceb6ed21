#!/usr/bin/env bash
# One GPU call: environment, GPU tests, tuning sweeps and benchmarks, logs and CSV under $OUT.
#   bash scripts/gpu_run.sh [tests] [tune-prefill] [tune-decode] [bench-prefill] [bench-decode]
#                          [bench-llm-decode] [bench-llm-prefill[-a|-b]] [overhead] [demo]
#                          [tests-model] [tests-inline] [layerbench] [e2e] [e2e-opaque] [e2e-static] [e2e-small] [tests-gluon] [bench-gluon]
#                          [compare-SUITE] [tests-int4p] [bench-int4] [tests-formats] [e2e-checkpoint]
#                          [e2e-moe] [moebench] [loadbench] [census] [tests-qk] [qk-compile] [pack]
#                          [tests-gpu-1] [tests-gpu-2] [tests-gpu-3] [tests-gpu-all] [tests-perf]
# Every GPU test (every test tests/conftest.py deselects on a CPU) in four steps, one a call (times:
# estimates from earlier runs of the same files on an H200):
#   tests-gpu-1  test_gluon.py                   -m "gpu and not perf", 8 workers   about 3 min
#   tests-gpu-2  test_gpu.py, test_int4p.py      likewise                           about 2-3 min
#   tests-gpu-3  every other test file           likewise, .whl/ as tests-formats   about 3-4 min
#   tests-perf   the tests that time themselves  -m perf, one worker (timings need the GPU alone)
#   tests-gpu-all  tests-gpu-1, -2 and -3 in one pytest (.whl/ as tests-gpu-3)      about 8 min at 14 workers
# (test_kernels.py is no GPU test: the CPU suite runs it in the interpreter, the tests step on the GPU.)
# Each writes $OUT/junit-<step>.xml (stamped with the GPU, versions, commit), the log's tail
# ($OUT/tests_gpu_1.log, ...) and $OUT/gpu-tests/{summary.md,tests.csv} over every junit-*.xml in $OUT;
# pytest gets SIGINT after STEP_TIMEOUT (default 540 s for these steps) so that the XML is still written.
# The commit: TILEQ_COMMIT=<sha> from the caller (the GPU's copy has no .git), else git rev-parse HEAD,
# else a file GIT_COMMIT at the root. The committed summary of a run: every part's XML, then here
#   python3 scripts/gpu_test_summary.py junit-*.xml --results bench/results
# writes bench/results/<gpu>/gpu-tests-<date>/ (summary.md, tests.csv).
# Tables written by the tune steps are used by the later steps of the same call.
# Environment: TEST_FILTER, TUNE_CASES, TUNE_M, TUNE_SECONDS, BENCH_CASES, BENCH_SECONDS,
#              GLUON_CASES, GLUON_ARGS (bench-gluon), INT4_CASES, INT4_ARGS (bench-int4),
#              E2E_ARGS (extra arguments of tileq e2e), LAYER_ARGS (of tileq layerbench),
#              OVERHEAD_ARGS (of tileq overhead), CENSUS_ARGS (of scripts/launch_census.py), MOE_E2E_ARGS (of tileq e2e --model qwen3-moe), MOE_ARGS (of tileq moebench),
#              LOAD_ARGS (of tileq loadbench: --model, --layers 8,40, --configs, --repeats, ...),
#              CKPT_CONFIGS (e2e-checkpoint's configs, default A8W8,W4A16), CKPT_LAYERS (default 4),
#              CKPT_ARGS (extra arguments of tileq e2e --make-checkpoint), CKPT_E2E_ARGS (of its tileq e2e runs),
#              QK_LAYERS, QK_ARGS (of qk-compile's tileq e2e run), BASELINE_SRC, COMPARE_CASES, COMPARE_ARGS (compare-*),
#              TILEQ_COMMIT, TEST_WORKERS (the tests-gpu steps' pytest workers, default 8).
# tests-formats installs the wheels in .whl/ (compressed-tensors and what it needs, made by pip download in
# the checkout; pass carry [".whl"]) into /tmp/site, used by that step only (and by tests-gpu-3).
# Runs on the GPU machine (H100 or H200) with its own python3 (torch 2.11, Triton 3.6): PYTHONPATH=src. The test
# steps name every skipped test and its reason (pytest -rs): a skip is not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=src PYTHONUNBUFFERED=1 TILEQ_TEST_GPU=1
# A fresh inductor cache per call: its FX graph / AOTAutograd caches key on the traced graph, not on
# tileq's Python deciding the launches, so a machine kept between calls would rerun a graph compiled
# by the code of an earlier call (seen 2026-12-07). Pass TORCHINDUCTOR_CACHE_DIR to keep one.
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-$(mktemp -d /tmp/inductor-XXXX)}"
unset TRITON_INTERPRET
if [ -z "${TILEQ_COMMIT:-}" ]; then
  TILEQ_COMMIT=$(git rev-parse HEAD 2>/dev/null || head -1 GIT_COMMIT 2>/dev/null || echo unknown)
fi
export TILEQ_COMMIT
OUT="${OUT:-/tmp/tileq-out}"
# STEP_TIMEOUT (seconds): each step's python is killed after it (e2e and bench write as they go).
PY="timeout -k 10 ${STEP_TIMEOUT:-0} python3"
mkdir -p "$OUT"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests)
status=0
{
  date -u +"date: %Y-%m-%dT%H:%M:%SZ"
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)"
  echo "commit: $TILEQ_COMMIT"
} | tee "$OUT/env.txt"

# The wheels in .whl/ (tests-formats) installed into /tmp/site; sets site to the PYTHONPATH to use.
formats_site() {
  site=src
  if [ -d .whl ]; then
    if python3 -m pip --version >/dev/null 2>&1; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    else  # a venv without pip: the wheels are plain archives (no .data, no scripts)
      rm -rf /tmp/site && for w in .whl/*.whl; do python3 -m zipfile -e "$w" /tmp/site; done
    fi
    site=/tmp/site:src
  fi
}

# gpu_tests STEP WORKERS MARKS PYTEST-ARGS...: pytest with JUnit XML (stamped with the machine's facts),
# the log's tail, and the summary of every junit-*.xml in $OUT. SIGINT at the timeout: pytest stops
# and still writes the XML of the tests it ran. Returns pytest's status.
gpu_tests() {
  local step=$1 workers=$2 marks=$3 rc
  shift 3
  local xml="$OUT/junit-$step.xml" log="$OUT/${step//-/_}.log"
  rm -f "$xml"
  timeout -s INT -k 60 "${STEP_TIMEOUT:-540}" python3 -m pytest -q -rs -p no:cacheprovider ${workers:+-n "$workers"} \
    -m "$marks" -o junit_family=xunit1 --junitxml="$xml" "$@" ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 \
    | tail -n 400 > "$log"
  rc=${PIPESTATUS[0]}
  tail -n 40 "$log"
  python3 scripts/gpu_test_summary.py --stamp "$xml" --part "$step" --status "$rc"
  python3 scripts/gpu_test_summary.py "$OUT"/junit-*.xml --out "$OUT/gpu-tests" >/dev/null
  grep -E '^# GPU tests|\((failed|error), ' "$OUT/gpu-tests/summary.md" | head -n 30
  return "$rc"
}
for step in "${steps[@]}"; do
  t0=$(date +%s)
  case "$step" in
    tests)
      $PY -m pytest -q -rs -p no:cacheprovider -n 12 tests/test_gpu.py tests/test_kernels.py ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tail -40 | tee "$OUT/tests.log" ;;
    tests-gpu-all)
      # tests-gpu-1, -2 and -3 in one pytest: the workers a long file's tail would leave idle take
      # the other files' tests (one call instead of three where device time is short).
      formats_site
      PYTHONPATH=$site gpu_tests "$step" "${TEST_WORKERS:-8}" "gpu and not perf" tests/ ;;
    tests-gpu-1)
      gpu_tests "$step" "${TEST_WORKERS:-8}" "gpu and not perf" tests/test_gluon.py ;;
    tests-gpu-2)
      gpu_tests "$step" "${TEST_WORKERS:-8}" "gpu and not perf" tests/test_gpu.py tests/test_int4p.py ;;
    tests-gpu-3)
      # Every other file, new ones included (test_formats.py's GPU tests need .whl/: see tests-formats).
      formats_site
      PYTHONPATH=$site gpu_tests "$step" "${TEST_WORKERS:-8}" "gpu and not perf" tests/ \
        --ignore=tests/test_gluon.py --ignore=tests/test_gpu.py --ignore=tests/test_int4p.py ;;
    tests-perf)
      gpu_tests "$step" "" "perf" tests/ ;;
    tests-model)
      # The model layer's GPU tests: activation quantization, QuantLinear, custom ops, CUDA graphs,
      # Hugging Face models, checkpoint formats (every test file's gpu-marked tests but the kernels'),
      # less the timed ones (tests-perf).
      $PY -m pytest -q -rs -p no:cacheprovider -n 8 -m "gpu and not perf" tests/ --ignore=tests/test_gpu.py \
        --ignore=tests/test_kernels.py ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tee "$OUT/tests_model.log" | tail -40 ;;
    tests-int4p)
      # Prepacked int4 weights (tileq.prepacked): the layout and the kernel's inline-PTX conversion.
      $PY -m pytest -q -rs -p no:cacheprovider -n 8 tests/test_int4p.py ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 \
        | tail -20 | tee "$OUT/tests_int4p.log" ;;
    bench-int4)
      # Prepacked int4 (W4A16, W4A8) against bf16 cuBLAS and tileq int8/fp8 rowcol over the int4 suite's
      # llm and untuned sets, every path the dispatch layer chooses between timed too (tileq_int4:<variant>),
      # CUDA-graph replays in 3 interleaved rounds: $OUT/int4/ (results.csv, report.md, plots), then the
      # int4 rules replayed on them ($OUT/int4/replay-<rule>.md). INT4_CASES: the cases (default: the int4
      # set); INT4_ARGS: more tileq bench arguments (--shapes, --m-max, --no-plots, ...; a later --shapes
      # wins over the default). The whole set does not fit one 10-minute call: split it with --shapes / --m-*.
      $PY -m tileq bench --suite int4 --cases "${INT4_CASES:-int4}" --int4-variants --shapes '^(llm|untuned)\.' \
        --graphs --warmup 5 --runs 30 --rounds 3 --out "$OUT/int4" --time-budget "${BENCH_SECONDS:-480}" --no-progress \
        ${INT4_ARGS:-} 2>&1 | tail -40 | tee "$OUT/bench_int4.log"
      brc=${PIPESTATUS[0]}
      for rule in int4-decode int4-prefill int4-streamk int4-w4a8; do
        $PY -m tileq replay "$OUT/int4/results.csv" --rule "$rule" --out "$OUT/int4/replay-$rule.md" 2>&1 \
          | grep -E '^(## |\| |tileq replay)' | head -20 | tee -a "$OUT/bench_int4.log"
      done
      (exit "$brc") ;;
    tests-gluon)
      # The sm_90 Gluon prefill kernel (opt-in, TILEQ_GLUON=1 inside the tests) against the reference.
      $PY -m pytest -q -rs -p no:cacheprovider -n 8 tests/test_gluon.py ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 \
        | tail -40 | tee "$OUT/tests_gluon.log" ;;
    bench-gluon)
      # The sm_90 Gluon prefill kernel (tileq_gluon) against the portable Triton kernel (tileq_triton)
      # and the torch baselines over the gluon-prefill suite, every tiling of its wave model timed too
      # (tileq_gluon:<tiling>), CUDA-graph replays in 3 interleaved rounds: $OUT/gluon/ (results.csv,
      # report.md, plots), then the wave model replayed on them (tileq replay --rule gluon-tiles,
      # $OUT/gluon/replay.md). GLUON_CASES: the cases (default rowcol:fp8xfp8:rcr; 'gluon' = all five
      # of the kernel's); GLUON_ARGS: more tileq bench arguments (--m-max, --shapes, --no-plots, ...).
      $PY -m tileq bench --suite gluon-prefill --cases "${GLUON_CASES:-rowcol:fp8xfp8:rcr}" \
        --impls gluon,triton --gluon-tilings --graphs --warmup 10 --runs 30 --rounds 3 --out "$OUT/gluon" \
        --time-budget "${BENCH_SECONDS:-480}" --no-progress ${GLUON_ARGS:-} 2>&1 | tail -40 | tee "$OUT/bench_gluon.log"
      brc=${PIPESTATUS[0]}
      $PY -m tileq replay "$OUT/gluon/results.csv" --rule gluon-tiles --out "$OUT/gluon/replay.md" 2>&1 \
        | tail -30 | tee -a "$OUT/bench_gluon.log"
      (exit "$brc") ;;
    layerbench)
      $PY -m tileq layerbench --out "$OUT/layers" ${LAYER_ARGS:-} 2>&1 | tail -60 | tee "$OUT/layerbench.log" ;;
    e2e)
      $PY -m tileq e2e --out "$OUT/e2e" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e.log" | tail -40 ;;
    e2e-opaque)
      # The same run with every tileq op opaque under torch.compile (TILEQ_INLINE_LAUNCH=0): the baseline
      # of the inlined launches.
      TILEQ_INLINE_LAUNCH=0 $PY -m tileq e2e --out "$OUT/e2e_opaque" ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e_opaque.log" \
        | tail -40 ;;
    e2e-static)
      # The same run with inductor's C++ launcher for user-defined kernels (tileq's, once inlined):
      # TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 (a torch setting, off by default).
      TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS=1 $PY -m tileq e2e --out "$OUT/e2e_static" \
        ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e_static.log" | tail -40 ;;
    tests-inline)
      # Inductor launching tileq's kernels (tests/test_inline_gpu.py): outputs bit for bit, then the host
      # timing alone (no parallel tests beside it).
      { $PY -m pytest -q -rs -p no:cacheprovider -n 4 -m gpu tests/test_inline_gpu.py -k "not host_time" \
          ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1 | tail -25
        $PY -m pytest -q -s -p no:cacheprovider -m gpu tests/test_inline_gpu.py -k host_time 2>&1 \
          | grep -E "host us|passed|failed|Error"
      } | tee "$OUT/tests_inline.log" ;;
    e2e-small)
      $PY -m tileq e2e --out "$OUT/e2e_small" --layers 2 --tokens 16 --eager-tokens 4 --prompt 64 \
        ${E2E_ARGS:-} 2>&1 | tee "$OUT/e2e_small.log" | tail -40 ;;
    tests-formats)
      # Checkpoint formats (issue #12) on the GPU: test_formats.py's gpu-marked tests make their
      # checkpoints with compressed-tensors (absent here: installed from .whl/ when carried) and
      # test_formats_gpu.py's need no producing library.
      formats_site
      { PYTHONPATH=$site python3 -c "import compressed_tensors as c; print('compressed-tensors', c.__version__)" \
          || echo "compressed-tensors is not importable: test_formats.py will be skipped (carry .whl)"
        PYTHONPATH=$site $PY -m pytest -q -rs -p no:cacheprovider -n 4 -m gpu tests/test_formats.py \
          tests/test_formats_gpu.py ${TEST_FILTER:+-k "$TEST_FILTER"} 2>&1; } | tee "$OUT/tests_formats.log" | tail -40 ;;
    e2e-checkpoint)
      # tileq e2e --checkpoint: Qwen3-14B-shaped checkpoints (CKPT_LAYERS layers, random weights)
      # written here by tileq e2e --make-checkpoint under /tmp (not copied back), each loaded with
      # tileq.from_pretrained and timed against bf16 with its shapes. A config e2e reports FAILED
      # fails the step.
      ck=/tmp/tileq-ckpt
      layers=${CKPT_LAYERS:-4}
      cfgs=${CKPT_CONFIGS:-A8W8,W4A16}
      erc=0
      rm -rf "$ck"
      $PY -m tileq e2e --make-checkpoint "$ck" --layers "$layers" --configs "$cfgs" ${CKPT_ARGS:-} 2>&1 \
        | tee "$OUT/make_checkpoint.log"
      [ "${PIPESTATUS[0]}" -ne 0 ] && erc=1
      for c in ${cfgs//,/ }; do
        [ "$erc" -ne 0 ] && [ ! -d "$ck/$c" ] && continue
        log="$OUT/e2e_checkpoint_$c.log"
        $PY -m tileq e2e --checkpoint "$ck/$c" --out "$OUT/e2e_checkpoint/$c" --layers "$layers" \
          --tokens 16 --eager-tokens 4 --prompt 64 ${CKPT_E2E_ARGS:-} 2>&1 | tee "$log" | tail -30
        [ "${PIPESTATUS[0]}" -ne 0 ] && erc=1
        grep -q "FAILED" "$log" && erc=1
      done
      rm -rf "$ck"
      (exit "$erc") ;;
    tune-prefill)
      $PY -m tileq tune --out "$OUT/tuned_prefill.json" --m 4096 ${TUNE_CASES:+--cases "$TUNE_CASES"} \
        --max-seconds "${TUNE_SECONDS:-240}" --jobs 14 2>&1 | tail -5 | tee "$OUT/tune_prefill.log"
      export TILEQ_TUNED_TABLES="$OUT/tuned_prefill.json${TILEQ_TUNED_TABLES:+:$TILEQ_TUNED_TABLES}" ;;
    tune-decode)
      $PY -m tileq tune --out "$OUT/tuned_decode.json" --m "${TUNE_M:-1,4,16,64}" ${TUNE_CASES:+--cases "$TUNE_CASES"} \
        --max-seconds "${TUNE_SECONDS:-240}" --jobs 14 2>&1 | tail -5 | tee "$OUT/tune_decode.log"
      export TILEQ_TUNED_TABLES="$OUT/tuned_decode.json${TILEQ_TUNED_TABLES:+:$TILEQ_TUNED_TABLES}" ;;
    bench-prefill)
      $PY -m tileq bench --suite prefill-targets ${BENCH_CASES:+--cases "$BENCH_CASES"} --out "$OUT/prefill" \
        --time-budget "${BENCH_SECONDS:-200}" --no-progress 2>&1 | tail -40 | tee "$OUT/bench_prefill.log" ;;
    bench-decode)
      $PY -m tileq bench --suite decode-targets ${BENCH_CASES:+--cases "$BENCH_CASES"} --out "$OUT/decode" \
        --time-budget "${BENCH_SECONDS:-200}" --no-progress 2>&1 | tail -40 | tee "$OUT/bench_decode.log" ;;
    compare-*)
      # Before/after on one suite in one call: the suite run on the tree in $BASELINE_SRC (default
      # .baseline/src: a copy of an earlier commit's src/, carried), then on this tree with --compare
      # against it. COMPARE_CASES narrows both runs (--cases); COMPARE_ARGS: more tileq bench
      # arguments for both (--m-max, --shapes, --no-plots, ...). compare-llm-decode, compare-int4, ...
      suite=${step#compare-}
      PYTHONPATH=${BASELINE_SRC:-.baseline/src} $PY -m tileq bench --suite "$suite" --out "$OUT/before-$suite" \
        ${COMPARE_CASES:+--cases "$COMPARE_CASES"} --time-budget "${BENCH_SECONDS:-200}" --no-progress \
        ${COMPARE_ARGS:-} 2>&1 | tail -5 | tee "$OUT/compare_before_$suite.log"
      $PY -m tileq bench --suite "$suite" --out "$OUT/after-$suite" ${COMPARE_CASES:+--cases "$COMPARE_CASES"} \
        --time-budget "${BENCH_SECONDS:-200}" --no-progress --compare "$OUT/before-$suite/results.csv" \
        ${COMPARE_ARGS:-} 2>&1 | tail -40 | tee "$OUT/compare_$suite.log" ;;
    bench-llm-decode|bench-llm-prefill|bench-llm-prefill-a|bench-llm-prefill-b)
      suite=${step#bench-}
      $PY -m tileq bench --suite "$suite" --out "$OUT/$suite" --time-budget "${BENCH_SECONDS:-200}" \
        --no-progress 2>&1 | tail -40 | tee "$OUT/bench_$suite.log" ;;
    overhead)
      # OVERHEAD_ARGS: more tileq overhead arguments (--configs, --m, ...; a later one wins).
      $PY -m tileq overhead --m 1 --n 5120 --k 5120 --csv "$OUT/overhead.csv" ${OVERHEAD_ARGS:-} 2>&1 | tail -24 \
        | tee "$OUT/overhead.log" ;;
    tests-qk|qk-compile)
      # The decode step's own kernels in compiled code: the q/k route (TILEQ_QK_ROPE=1) and the split-KV
      # decode attention (TILEQ_DECODE_ATTN): their GPU tests (inductor's code launches the kernels and
      # writes the cache in place; the attention against sdpa); qk-compile then runs a compile / graph
      # A/B of one model (QK_LAYERS layers, default 8; QK_ARGS: more tileq e2e arguments; 40 layers
      # take about 3 min a config).
      $PY -m pytest -q -rs -p no:cacheprovider -m gpu tests/test_model_gpu.py \
        -k "compiled_decode_step or qk_norm_rope or decode_attention" 2>&1 | grep -E "passed|failed|Error|SKIP" \
        | tail -8 | tee "$OUT/qk_compile_tests.log"
      [ "$step" = tests-qk ] || $PY -m tileq e2e --out "$OUT/qk_compile" --layers "${QK_LAYERS:-8}" --configs \
        bf16,A8W8:fused@TILEQ_DECODE_ATTN=0,A8W8:fused,A8W8:fused@TILEQ_QK_ROPE=1 --modes compile,graph \
        --batches 1 --no-compile-ttft --eager-tokens 16 --tokens 64 ${QK_ARGS:-} 2>&1 \
        | tee "$OUT/qk_compile.log" | grep -E "^\| (config|bf16|A8W8|FP8)" | head -12 ;;
    census)
      # Host cost of a decode step per config and mode (eager, eager without PDL, compiled): launches,
      # direct-launch misses, syncs, wall against kernel ms (scripts/launch_census.py; CENSUS_ARGS).
      $PY scripts/launch_census.py --csv "$OUT/census.csv" ${CENSUS_ARGS:-} 2>&1 | grep -v Warning \
        | tee "$OUT/census.log" | tail -30 ;;
    demo)
      $PY -m tileq demo 2>&1 | tail -40 | tee "$OUT/demo.log" ;;
    e2e-moe)
      # tileq e2e --model qwen3-moe: a Qwen3-30B-A3B-shaped MoE model, bf16 grouped_mm experts vs tileq.
      $PY -m tileq e2e --model qwen3-moe --out "$OUT/e2e_moe" ${MOE_E2E_ARGS:-} 2>&1 | tee "$OUT/e2e_moe.log" | tail -30 ;;
    moebench)
      $PY -m tileq moebench --out "$OUT/moe" ${MOE_ARGS:-} 2>&1 | tail -40 | tee "$OUT/moebench.log" ;;
    loadbench)
      # tileq loadbench: peak GPU memory and time of bf16 from_pretrained, + quantize_, and quantize-on-load
      # (each load in a fresh process). Its bf16 checkpoints (random weights; 40 layers of qwen3-14b: 29.5 GB)
      # go under /tmp, never $OUT (not copied back), each removed once measured.
      ck=/tmp/tileq-loadbench
      rm -rf "$ck"
      $PY -m tileq loadbench --out "$OUT/load" --workdir "$ck" ${LOAD_ARGS:-} 2>&1 | tee "$OUT/loadbench.log" | tail -30
      lrc=${PIPESTATUS[0]}
      rm -rf "$ck"
      (exit "$lrc") ;;
    pack)
      # The device tool brings back at most 8 files, 2 folders down: everything else under $OUT goes
      # into one archive ($OUT/all.tgz); the logs' last lines stay readable in the call's output.
      (cd "$OUT" && tar czf /tmp/all.tgz . && find . -mindepth 1 -maxdepth 1 ! -name env.txt -exec rm -rf {} + \
        && mv /tmp/all.tgz all.tgz) ;;
    *) echo "unknown step $step"; status=1 ;;
  esac
  rc=${PIPESTATUS[0]}
  [ "$rc" -ne 0 ] && status=$rc
  echo "== step $step: rc=$rc, $(( $(date +%s) - t0 )) s"
done
exit $status
