#!/usr/bin/env bash
# Runs every libFuzzer target for a bounded time: GRADCOMP_FUZZ_SECONDS in total (default 160),
# split evenly among the targets; docs/fuzzing.md.
#   scripts/run_fuzzers.sh [TREE]   TREE: the build tree holding fuzz/ (default build-asan, as
#                                   scripts/build_sanitized.sh makes it)
# frame_fuzz's seeds are generated (every codec's frames); the others are committed under
# tests/fuzz/corpus/<target>. New units go to TREE/corpus/<target>, findings to
# TREE/findings/<target>-crash-*. UBSan halts, so undefined behaviour is a finding too.
# Exits non-zero on the first finding, with its log's tail and the crashing input's path.
set -euo pipefail
cd "$(dirname "$0")/.."
tree=${1:-build-asan}
[[ -x $tree/fuzz/frame_fuzz ]] || { echo "run_fuzzers: no fuzz targets in $tree/fuzz"; exit 1; }
fuzz_targets=(frame_fuzz plan_fuzz profile_fuzz cluster_fuzz codec_costs_fuzz feedback_state_fuzz
              codec_state_fuzz engine_state_fuzz auto_settings_fuzz)
fuzz_each=$(( ${GRADCOMP_FUZZ_SECONDS:-160} / ${#fuzz_targets[@]} ))
(( fuzz_each >= 1 )) || fuzz_each=1
echo "fuzzers: ${#fuzz_targets[@]} targets in $tree/fuzz, ${fuzz_each} s each"
rm -rf "$tree/corpus" "$tree/findings" && mkdir -p "$tree/findings"
"$tree/fuzz/frame_fuzz_seeds" "$tree/corpus/frame_fuzz"
for target in "${fuzz_targets[@]}"; do
  mkdir -p "$tree/corpus/$target"
  seeds=()
  [[ -d "tests/fuzz/corpus/$target" ]] && seeds=("tests/fuzz/corpus/$target")
  log="$tree/$target.log"
  max_len=16384  # the committed engine states are up to 12 KB; frames stay at 4 KB as before
  [[ $target == frame_fuzz ]] && max_len=4096
  if ! UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$tree/fuzz/$target" \
      -max_total_time="$fuzz_each" -max_len="$max_len" -timeout=10 -print_final_stats=1 \
      -artifact_prefix="$tree/findings/$target-" \
      "$tree/corpus/$target" "${seeds[@]}" >"$log" 2>&1; then
    tail -n 80 "$log"
    echo "fuzzer $target failed; the crashing input:" \
      "$(sed -n 's/.*Test unit written to \(.*\)/\1/p' "$log" | tail -n 1)"
    exit 1
  fi
  echo "$target: $(grep -E '^stat::number_of_executed_units' "$log")"
done
