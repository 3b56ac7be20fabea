#!/usr/bin/env bash
# Every test: set up, then
#   1. the unit tests and the multi-process tests (ctest) on the Release build; multi-process
#      tests run as 2 and 4 ranks under mpirun (Open MPI) and under `gradcomp launch` (Gloo);
#      then the Python front end's tests (pytest, tests/python: real worker processes) and
#      the cluster benchmark's (tests/cluster: real network namespaces, DDP and gradcomp) and
#      the fault injection (tests/faults: a rank killed or stopped, ranks that disagree);
#   2. the same tests built with AddressSanitizer and UndefinedBehaviorSanitizer (the 4-rank
#      runs over Gloo; Open MPI's at 2 ranks, its 4-rank runs are step 1's);
#   3. the engine's tests built with ThreadSanitizer (its stage threads and the transports');
#   4. every libFuzzer target (clang; docs/fuzzing.md) for a bounded time: GRADCOMP_FUZZ_SECONDS
#      in total (default 160), split evenly among the targets.
# The trees of 2-4 (scripts/build_sanitized.sh) compile in the background at the lowest CPU
# priority while step 1 runs. Measured on 2 cores (CI of 581f8a0): they were built by the end
# of step 1, but pytest took 17.6 min instead of 10.1, so the whole run (43 min) gained about
# what building them in sequence would; building in sequence is the simpler choice.
# Stops at the first failure and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's heading says when it began, so a slow stage shows in any CI log.
stage() { echo "== $1 (at $((SECONDS / 60)) min $((SECONDS % 60)) s)"; }
scripts/setup.sh

# Its own process group (setsid), so that a failing stage stops it and every compiler under it.
setsid nice -n 19 scripts/build_sanitized.sh >build/sanitized-build.log 2>&1 &
sanitized_build=$!
trap 'kill -- -$sanitized_build 2>/dev/null || true' EXIT

jobs=$(nproc)
stage "unit tests (Release)"
ctest --test-dir build --output-on-failure -j "$jobs" | tee build/ctest.log

stage "Python front end, the cluster benchmark's parts and the fault injection (pytest)"
/usr/bin/python3 -m pytest -q --durations=10 tests/python tests/cluster tests/faults | tee build/pytest.log

stage "the sanitizer and fuzzer builds (begun in the background)"
if ! wait "$sanitized_build"; then
  tail -n 60 build/sanitized-build.log
  echo "scripts/build_sanitized.sh failed (build/sanitized-build.log; the lines above say why)"
  exit 1
fi

stage "unit tests under ASan + UBSan"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" -E '[.]mpi[.]np4$'

stage "engine tests under ThreadSanitizer"
TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan --output-on-failure -j "$jobs" \
  -R '^(Engine|engine_mptest[.]gloo|SparseSelect[.]CollectFinds)'

fuzz_targets=(frame_fuzz plan_fuzz profile_fuzz cluster_fuzz codec_costs_fuzz feedback_state_fuzz
              codec_state_fuzz engine_state_fuzz)
fuzz_each=$(( ${GRADCOMP_FUZZ_SECONDS:-160} / ${#fuzz_targets[@]} ))
(( fuzz_each >= 1 )) || fuzz_each=1
stage "fuzzers (libFuzzer, ${#fuzz_targets[@]} targets, ${fuzz_each} s each)"
# frame_fuzz's seeds are generated (every codec's frames); the others are committed under
# tests/fuzz/corpus/<target>. New units go to build-fuzz/corpus/<target>, findings to
# build-fuzz/findings/<target>-crash-*. UBSan halts, so undefined behaviour is a finding too.
rm -rf build-fuzz/corpus build-fuzz/findings && mkdir -p build-fuzz/findings
build-fuzz/fuzz/frame_fuzz_seeds build-fuzz/corpus/frame_fuzz
for target in "${fuzz_targets[@]}"; do
  mkdir -p "build-fuzz/corpus/$target"
  seeds=()
  [[ -d "tests/fuzz/corpus/$target" ]] && seeds=("tests/fuzz/corpus/$target")
  log="build-fuzz/$target.log"
  max_len=16384  # the committed engine states are up to 12 KB; frames stay at 4 KB as before
  [[ $target == frame_fuzz ]] && max_len=4096
  if ! UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "build-fuzz/fuzz/$target" \
      -max_total_time="$fuzz_each" -max_len="$max_len" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="build-fuzz/findings/$target-" \
      "build-fuzz/corpus/$target" "${seeds[@]}" >"$log" 2>&1; then
    tail -n 80 "$log"
    echo "fuzzer $target failed; the crashing input:" \
      "$(sed -n 's/.*Test unit written to \(.*\)/\1/p' "$log" | tail -n 1)"
    exit 1
  fi
  echo "$target: $(grep -E '^stat::number_of_executed_units' "$log")"
done

# One closing line: the Release tests (which also passed under ASan + UBSan above) and the
# Python front end's tests.
total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' build/ctest.log | tail -n 1)
python_passed=$(sed -n 's/^\([0-9]*\) passed.*/\1/p' build/pytest.log | tail -n 1)
total=$((total + ${python_passed:-0}))
stage "all tests passed"
echo "gradcomp: ${total} passed, 0 failed"
