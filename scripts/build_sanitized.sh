#!/usr/bin/env bash
# Configures and builds the two checking trees scripts/test.sh runs after the Release tests:
#   build-asan  every test and every libFuzzer target, with AddressSanitizer and
#               UndefinedBehaviorSanitizer (clang, Debug: asserts kept; the fuzz targets in
#               build-asan/fuzz, docs/fuzzing.md). One tree for both: the library is compiled
#               once for them. At -O1, as the sanitizers' authors advise: the tree builds in
#               563 s on 2 cores against 392 s at -O0, and scripts/test.sh's selection of its
#               tests ran in 154 s (its ctest line, alone) against 632 s at -O0 in CI with two
#               more multi-process tests (141 s of them); the fuzzers likewise faster. Clang's
#               notes on `omp simd` loops it leaves scalar at -O1 are silenced (-Wno-pass-failed);
#   build-tsan  the engine's tests, with ThreadSanitizer (GCC); their Gloo runs are started by
#               the Release build's launcher (build/bin/gradcomp), so the tool is not built here.
# Needs scripts/setup.sh first (the packages, and build/bin/gradcomp). Debug information is
# line tables only (-g1): sanitizer reports keep their file:line stacks, and the trees build
# about a tenth faster than with full debug information.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
launcher="$root/build/bin/gradcomp"
[[ -x $launcher ]] || { echo "build_sanitized: $launcher is missing; run scripts/setup.sh"; exit 1; }

echo "build_sanitized: build-asan (clang, ASan + UBSan: every test and the fuzz targets)"
# A tree configured with another compiler (GCC's ASan tree, before this was clang's) keeps
# its compiler in the cache whatever CXX says: start it afresh.
if [[ -f build-asan/CMakeCache.txt ]] &&
   ! grep -q '^CMAKE_CXX_COMPILER:[A-Z]*=.*clang++' build-asan/CMakeCache.txt; then
  rm -rf build-asan
fi
CXX=clang++ cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  -DCMAKE_CXX_FLAGS_DEBUG="-O1 -g1 -Wno-pass-failed" \
  -DGRADCOMP_SANITIZE=ON -DGRADCOMP_FUZZ=ON >/dev/null
cmake --build build-asan

echo "build_sanitized: build-tsan (ThreadSanitizer, the engine's tests)"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DGRADCOMP_TSAN=ON \
  -DGRADCOMP_LAUNCHER="$launcher" >/dev/null
# The programs of the tests scripts/test.sh runs under TSan: the engine's, the plan changes' and
# the servers' (engine_tests, *_mptest), the op queue's, the kept threads' (common_tests) and
# the sparse selection's (codec_tests).
cmake --build build-tsan --target engine_tests engine_mptest plan_change_mptest servers_mptest \
  op_queue_test common_tests codec_tests
echo "build_sanitized: done"
