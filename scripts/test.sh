#!/usr/bin/env bash
# Every test: set up, then
#   1. the unit tests and the multi-process tests (ctest) on the Release build; multi-process
#      tests run as 2 and 4 ranks under mpirun (Open MPI) and under `gradcomp launch` (Gloo);
#   2. the same tests built with AddressSanitizer and UndefinedBehaviorSanitizer (clang; the
#      multi-process tests at 2 ranks over Gloo, and some more, below);
#   3. the engine's tests and the transports' queue built with ThreadSanitizer (its stage threads
#      and the transports', and the kept threads they run on);
#   4. the Python front end's tests (pytest, tests/python: real worker processes), the cluster
#      benchmark's (tests/cluster: real network namespaces, DDP and gradcomp), the soak's tools
#      (tests/soak) and the fault injection (tests/faults: a rank killed or stopped, ranks that
#      disagree);
#   5. every libFuzzer target (clang; docs/fuzzing.md) for a bounded time: GRADCOMP_FUZZ_SECONDS
#      in total (default 160), split evenly among the targets (scripts/run_fuzzers.sh).
# The trees of 2, 3 and 5 are built by scripts/build_sanitized.sh (2 and 5 share one) beside
# steps 1 and 4, and the fuzzers run beside steps 2 and 3,
# both at the lowest CPU priority: much of pytest waits (for timeouts, rendezvous and
# rate-limited links), the fault injection mostly (for a stopped rank's timeout), and a build
# or a fuzzer at nice 19 takes the CPU only when nothing else wants it. So the stages run in
# the order 1, 4 (the Python tests, then the fault injection; the build beside them all), 2 and 3
# (the fuzzers beside them), 5 (the fuzzers' results).
# Stops at the first failure and exits non-zero.
set -euo pipefail
cd "$(dirname "$0")/.."
# Each stage's heading says when it began, and how busy the machine's CPUs were (every process,
# the background jobs too) since the heading before, so a CI log shows which stages are slow
# and whether they are slow for want of CPU (near 100%) or while waiting (well under).
cpu_busy=0 cpu_total=0
stage() {
  local _ user nice system idle iowait irq softirq steal busy total since=""
  read -r _ user nice system idle iowait irq softirq steal _ </proc/stat
  busy=$((user + nice + system + irq + softirq + steal))
  total=$((busy + idle + iowait))
  if ((cpu_total && total > cpu_total)); then
    since="; the CPUs $((100 * (busy - cpu_busy) / (total - cpu_total)))% busy since the last heading"
  fi
  cpu_busy=$busy cpu_total=$total
  echo "== $1 (at $((SECONDS / 60)) min $((SECONDS % 60)) s$since)"
}
stage "set-up: the Debian packages and the Release build (scripts/setup.sh)"
scripts/setup.sh


# A job at the lowest CPU priority in a process group of its own (setsid), so that a failing
# stage stops it and all under it: background <log> <command...>; its pid in $!.
# A session of its own is also a scheduling group of its own on a kernel with autogroups
# (/proc/sys/kernel/sched_autogroup_enabled, on by default in Debian's), and there nice weighs
# a process only against its own group: the group's own nice value is what counts against the
# tests. Measured here: a setsid build at nice 19 took half the CPU from pytest, which took
# 24 min instead of 13.5. So the job lowers its group too.
background() {
  local log=$1
  shift
  setsid bash -c 'echo 19 >/proc/self/autogroup 2>/dev/null || true; exec nice -n 19 "$@"' \
    background "$@" >"$log" 2>&1 &
}
# Waits for a background job and shows its log; fails with its log's last lines if it failed.
finish() {  # finish <pid> <log> <what>
  local status=0
  wait "$1" || status=$?
  if ((status)); then
    tail -n 60 "$2"
    echo "$3 failed (the lines above say why)"
    exit 1
  fi
  cat "$2"
}
jobs_in_background=()
trap 'for p in "${jobs_in_background[@]}"; do kill -- -"$p" 2>/dev/null || true; done' EXIT

# The sanitizer builds start as soon as the Release tree is there: the Release tests leave
# CPU idle too (a multi-process test holds both of ctest's slots and often waits).
background build/build_sanitized.log scripts/build_sanitized.sh
builds=$!
jobs_in_background+=("$builds")

jobs=$(nproc)
stage "unit tests (Release), the sanitizer builds beside"
ctest --test-dir build --output-on-failure -j "$jobs" | tee build/ctest.log

stage "Python front end, the cluster benchmark's and the soak's tools (pytest), the builds beside"
/usr/bin/python3 -m pytest -q --durations=10 tests/python tests/cluster tests/soak tests/layout |
  tee build/pytest.log

stage "fault injection (pytest), the sanitizer builds still beside"
# The fault tests mostly wait (for a stopped rank's timeout): the builds take what CPU they
# leave, as the fuzzers did when they ran beside them (274 s for the fault tests with the
# fuzzers beside, 255 s without).
/usr/bin/python3 -m pytest -q --durations=5 tests/faults | tee build/pytest-faults.log

stage "the sanitizer and fuzzer builds (finishing)"
finish "$builds" build/build_sanitized.log scripts/build_sanitized.sh

# The fuzzers (bounded in wall time) take what CPU the sanitized tests leave.
background build/run_fuzzers.log scripts/run_fuzzers.sh
fuzzers=$!
jobs_in_background+=("$fuzzers")

stage "unit tests under ASan + UBSan, the fuzzers beside"
# Under mpirun the tests set their own LSAN_OPTIONS (tests/transport/mpi_lsan.supp). The
# multi-process tests run at 2 ranks over Gloo; at 4 only the routes' (the hierarchical route
# needs two nodes of two) and the servers' and plan changes'; over Open MPI only the transport's
# and the servers', at 2 (the rest of the engine, the routes and the auto scheduler run on MPI
# and at 4 ranks in step 1: the same code as at 2 ranks over Gloo, which this tree checks; the
# coverage instrumentation of the fuzz targets makes this tree's processes about a quarter
# slower than step 1's, and the multi-process tests run one at a time).
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
  LSAN_OPTIONS=suppressions=$PWD/tests/lsan.supp:print_suppressions=0 \
  ctest --test-dir build-asan --output-on-failure -j "$jobs" \
  -E '([.]mpi[.]np4|(engine|rollback|transport|auto_scheduler)_mptest[.]gloo[.]np4|(engine|rollback|route|plan_change|auto_scheduler)_mptest[.]mpi[.]np2)$'

stage "engine tests under ThreadSanitizer"
# tests/tsan.supp: one report inside gloo, whose own ordering TSan cannot see (the file says why).
# The engine's multi-process test at 2 ranks only: a rank's threads are the same at 4 (48 s).
TSAN_OPTIONS=halt_on_error=1:suppressions=$PWD/tests/tsan.supp ctest --test-dir build-tsan --output-on-failure -j "$jobs" \
  -R '^(Engine|PlanChange|OpQueue|KeptThread|(engine|plan_change|servers)_mptest[.]gloo|SparseSelect[.]CollectFinds)' \
  -E '^engine_mptest[.]gloo[.]np4$'

stage "the fuzzers' results"
finish "$fuzzers" build/run_fuzzers.log scripts/run_fuzzers.sh

# One closing line: the Release tests (which also passed under ASan + UBSan above) and the
# Python front end's tests.
total=$(sed -n 's/.*tests failed out of \([0-9]*\).*/\1/p' build/ctest.log | tail -n 1)
for log in build/pytest.log build/pytest-faults.log; do
  passed=$(sed -n 's/^\([0-9]*\) passed.*/\1/p' "$log" | tail -n 1)
  total=$((total + ${passed:-0}))
done
stage "all tests passed"
echo "gradcomp: ${total} passed, 0 failed"
