#!/usr/bin/env bash
# Every test: set up, then
#   1. the unit tests and the multi-process tests (ctest) on the Release build; multi-process
#      tests run as 2 and 4 ranks under mpirun (Open MPI) and under `gradcomp launch` (Gloo);
#      then the Python front end's tests (pytest, tests/python: real worker processes) and
#      the cluster benchmark's (tests/cluster: real network namespaces, DDP and gradcomp);
#   2. the same tests built with AddressSanitizer and UndefinedBehaviorSanitizer;
#   3. the engine's tests built with ThreadSanitizer (its stage threads and the transports');
#   4. the frame-decoder fuzzer (libFuzzer, clang) for a bounded time (GRADCOMP_FUZZ_SECONDS,
#      default 60).
# Stops at the first failure and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

jobs=$(nproc)
echo "== unit tests (Release)"
ctest --test-dir build --output-on-failure -j "$jobs" | tee build/ctest.log

echo "== Python front end and the cluster benchmark's parts (pytest)"
/usr/bin/python3 -m pytest -q tests/python tests/cluster | tee build/pytest.log

echo "== unit tests under ASan + UBSan"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DGRADCOMP_SANITIZE=ON >/dev/null
cmake --build build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs"

echo "== engine tests under ThreadSanitizer"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DGRADCOMP_TSAN=ON >/dev/null
cmake --build build-tsan --target engine_test engine_fault_test engine_mptest gradcomp_cli
TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build-tsan --output-on-failure -j "$jobs" \
  -R '^(Engine|engine_mptest[.]gloo)'

echo "== frame fuzzer (libFuzzer, ${GRADCOMP_FUZZ_SECONDS:-60} s)"
CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADCOMP_FUZZ=ON -DGRADCOMP_TESTS=OFF >/dev/null
cmake --build build-fuzz --target frame_fuzz frame_fuzz_seeds
rm -rf build-fuzz/corpus && build-fuzz/fuzz/frame_fuzz_seeds build-fuzz/corpus
if ! build-fuzz/fuzz/frame_fuzz -max_total_time="${GRADCOMP_FUZZ_SECONDS:-60}" -max_len=4096 \
    -print_final_stats=1 build-fuzz/corpus >build-fuzz/fuzz.log 2>&1; then
  tail -n 80 build-fuzz/fuzz.log
  echo "frame fuzzer failed: the crashing input is saved as crash-* in $(pwd)"
  exit 1
fi
grep -E "^Done|^stat::(number_of_executed_units|new_units_added)" build-fuzz/fuzz.log

# One closing line: the Release tests (which also passed under ASan + UBSan above) and the
# Python front end's tests.
total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' build/ctest.log | tail -n 1)
python_passed=$(sed -n 's/^\([0-9]*\) passed.*/\1/p' build/pytest.log | tail -n 1)
total=$((total + ${python_passed:-0}))
echo "== all tests passed"
echo "gradcomp: ${total} passed, 0 failed"
