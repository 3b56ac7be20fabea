#!/usr/bin/env bash
# Configures and builds the three checking trees scripts/test.sh runs after the Release tests:
#   build-asan  every test, with AddressSanitizer and UndefinedBehaviorSanitizer (Debug);
#   build-tsan  the engine's tests, with ThreadSanitizer; their Gloo runs are started by the
#               Release build's launcher (build/bin/gradcomp), so the tool is not built here;
#   build-fuzz  the libFuzzer targets (clang; docs/fuzzing.md).
# Needs scripts/setup.sh first (the packages, and build/bin/gradcomp). Debug information is
# line tables only (-g1): sanitizer reports keep their file:line stacks, and the trees build
# about a tenth faster than with full debug information.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
launcher="$root/build/bin/gradcomp"
[[ -x $launcher ]] || { echo "build_sanitized: $launcher is missing; run scripts/setup.sh"; exit 1; }

echo "build_sanitized: build-asan (ASan + UBSan, every test)"
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DCMAKE_CXX_FLAGS_DEBUG=-g1 \
  -DGRADCOMP_SANITIZE=ON >/dev/null
cmake --build build-asan

echo "build_sanitized: build-tsan (ThreadSanitizer, the engine's tests)"
cmake -S . -B build-tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DGRADCOMP_TSAN=ON \
  -DGRADCOMP_LAUNCHER="$launcher" >/dev/null
cmake --build build-tsan --target engine_test engine_fault_test engine_mptest sparse_select_test

echo "build_sanitized: build-fuzz (libFuzzer targets, clang)"
CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DGRADCOMP_FUZZ=ON \
  -DGRADCOMP_TESTS=OFF >/dev/null
cmake --build build-fuzz --target fuzz_targets
echo "build_sanitized: done"
