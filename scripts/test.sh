#!/usr/bin/env bash
# Every test: set up, then
#   1. the unit tests (ctest) on the Release build;
#   2. the same tests built with AddressSanitizer and UndefinedBehaviorSanitizer;
#   3. the frame-decoder fuzzer (libFuzzer, clang) for a bounded time (GRADCOMP_FUZZ_SECONDS,
#      default 60).
# Stops at the first failure and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh

jobs=$(nproc)
echo "== unit tests (Release)"
ctest --test-dir build --output-on-failure -j "$jobs"

echo "== unit tests under ASan + UBSan"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DGRADCOMP_SANITIZE=ON >/dev/null
cmake --build build-asan
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs"

echo "== frame fuzzer (libFuzzer, ${GRADCOMP_FUZZ_SECONDS:-60} s)"
CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADCOMP_FUZZ=ON -DGRADCOMP_TESTS=OFF >/dev/null
cmake --build build-fuzz --target frame_fuzz frame_fuzz_seeds
rm -rf build-fuzz/corpus && build-fuzz/fuzz/frame_fuzz_seeds build-fuzz/corpus
build-fuzz/fuzz/frame_fuzz -max_total_time="${GRADCOMP_FUZZ_SECONDS:-60}" -max_len=4096 \
  -print_final_stats=1 build-fuzz/corpus 2>&1 | tail -n 40

echo "== all tests passed"
