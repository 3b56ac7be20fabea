#!/bin/bash
# Runs every command of the "Validation" section of docs/simulation.md: the published settings
# of MergeComp, Espresso and the utility study reproduced with `gradcomp simulate`, `plan` and
# `utility`, the planner's decision times, and the plots in docs/img/.
#
#   bash scripts/validate_simulation.sh [OUT_DIR]     (default /tmp/gradcomp-validation)
#
# GRADCOMP=path/to/gradcomp picks the binary (default build/bin/gradcomp). Each command's output
# goes to OUT_DIR/<name>.txt; the tables in docs/simulation.md are read off those files. The
# inputs under profiles/validation/ come from scripts/make_validation_inputs.py.
set -euo pipefail
cd "$(dirname "$0")/.."
G=${GRADCOMP:-build/bin/gradcomp}
OUT=${1:-/tmp/gradcomp-validation}
mkdir -p "$OUT" docs/img
GPU=profiles/validation/codec-costs-v100.json
LAMBDA=1.05
SLICE_FROM=4194304  # 2^22: the Espresso plans may cut tensors of this size into slices (off by default)

# Runs one command, keeping its output in OUT/$1.txt (and saying which command made it).
run() {
  local name=$1
  shift
  { printf '$ gradcomp'; printf ' %q' "$@"; echo; nice "$G" "$@"; } >"$OUT/$name.txt" 2>&1
  echo "$OUT/$name.txt"
}

# Runs `gradcomp plan` (OUT/$1.txt, the plan in OUT/$1.json), then simulates that plan with every
# bucket encoded on the compute thread (OUT/$1-caller.txt): on a GPU, encoding shares the device
# with backward, which the planner's engine-thread encoding (a CPU thread of its own) does not.
plan_both() {
  local name=$1 profile=$2
  shift 2
  run "$name" plan --profile "$profile" "$@" --json "$OUT/$name.json" >/dev/null
  /usr/bin/python3 -c '
import json, sys
plan = json.load(open(sys.argv[1]))
for bucket in plan["buckets"]:
    bucket["encode_on"] = "caller"
json.dump(plan, open(sys.argv[2], "w"), indent=1)' "$OUT/$name.json" "$OUT/$name-caller.json"
  local cluster=()
  while [ $# -gt 0 ]; do  # the plan's flags minus those only `plan` takes
    case $1 in
      --codecs) shift 2 ;;
      *) cluster+=("$1"); shift ;;
    esac
  done
  run "$name-caller" simulate --profile "$profile" "${cluster[@]}" --plan "$OUT/$name-caller.json"
}

# MergeComp: one server of 8 V100s, ResNet-101 on ImageNet at 64 images per GPU; PCIe at
# Espresso's constant (2.5 GB/s = 20gbit) and at 6gbit, where our FP32 matches the published 53%.
MERGECOMP="none;fp16|none|allreduce;dgc:ratio=0.01|dgc|allgather;efsignsgd|ef|allgather"
MERGECOMP+=";signsgd|none|allgather;signum|none|allgather;onebit|ef|allgather"
MERGECOMP+=";randomk:ratio=0.01|ef|allgather;topk:ratio=0.01|ef|allgather;qsgd|ef|allgather"
B64=profiles/validation/resnet101-b64.json
ONE_SERVER=(--workers 8 --per-node 8 --lambda $LAMBDA --costs $GPU)
for pcie in 20gbit 6gbit; do
  run "mergecomp-$pcie-layerwise" simulate --profile $B64 "${ONE_SERVER[@]}" --intra $pcie --encode-on caller \
      --bucket-mb 0.000001 --min-compress 0 --codecs "$MERGECOMP"
  run "mergecomp-$pcie-25mb" simulate --profile $B64 "${ONE_SERVER[@]}" --intra $pcie --encode-on caller \
      --min-compress 0 --codecs "$MERGECOMP"
  IFS=';' read -ra codecs <<<"$MERGECOMP"
  for codec in "${codecs[@]}"; do
    plan_both "mergecomp-$pcie-plan-${codec%%[:|]*}" $B64 "${ONE_SERVER[@]}" --intra $pcie --codecs "$codec"
  done
done
# MergeComp on NVLink (Espresso's constant, 50 GB/s = 400gbit) with FP16, 2 to 8 GPUs.
for w in 2 4 8; do
  run "mergecomp-nvlink-$w" simulate --profile profiles/validation/resnet101-b64.json --workers $w \
      --per-node $w --intra 400gbit --lambda $LAMBDA --costs $GPU --encode-on caller \
      --min-compress 0 --codecs "none;fp16|none|allreduce"
  plan_both "mergecomp-nvlink-$w-plan" $B64 --workers $w --per-node $w --intra 400gbit \
      --lambda $LAMBDA --costs $GPU --codecs fp16
done

# Espresso: 64 V100s, 8 per machine; NVLink + 100 Gbit/s or PCIe + 25 Gbit/s; each model with
# the compressor of its Figure 12/13 run. GC with GPU: Espresso's comm type 4 shape (compressed
# allgather among nodes), V100 costs on the compute stream, by the leader route and by the sharded
# route (each local rank compresses its shard: Espresso's own shape); GC with CPU: BytePS-Compress's shape
# (fp16 inside the node, compressed push/pull with server re-compression), our CPU costs over
# BytePS's 4 OpenMP threads; Espresso: our planner with V100 costs.
while read -r model codec intra inter; do
  NET=(--workers 64 --per-node 8 --intra "$intra" --inter "$inter" --lambda $LAMBDA)
  run "espresso-$model-gpu" simulate --profile $model "${NET[@]}" --costs $GPU --encode-on caller \
      --codecs "none;$codec|ef|hierarchical:inner=allgather;$codec|ef|sharded:inner=allgather"
  run "espresso-$model-cpu" simulate --profile $model "${NET[@]}" --cost-scale 0.25 \
      --codecs "$codec|ef|hierarchical:inner=twoway,intra=fp16;$codec|ef|twoway"
  plan_both "espresso-$model-plan" $model "${NET[@]}" --costs $GPU --codecs "none,fp16,$codec|ef" \
      --slice-from $SLICE_FROM
  for i in $(seq 5); do  # decision time: wall time on a shared machine, so several runs
    run "decision-espresso-$model-$i" plan --profile $model "${NET[@]}" --costs $GPU \
        --codecs "none,fp16,$codec|ef" --slice-from $SLICE_FROM
    # ... and without trying slices (what the search over slicings adds)
    run "decision-espresso-$model-whole-$i" plan --profile $model "${NET[@]}" --costs $GPU \
        --codecs "none,fp16,$codec|ef" --slice-from 0
  done
done <<'EOF'
bert-base randomk:ratio=0.01 400gbit 100gbit
gpt2-small efsignsgd 400gbit 100gbit
lstm efsignsgd 20gbit 25gbit
resnet101 dgc:ratio=0.01 20gbit 25gbit
vgg16 randomk:ratio=0.01 20gbit 25gbit
EOF

# Decision time: the issue's ResNet-101 case and 2,000 tensors, ten runs each (wall time on a
# shared machine varies; the table gives the least and the median).
FIVE=none,fp16,topk:ratio=0.01,efsignsgd,randomk:ratio=0.01
for i in $(seq 10); do
  run "decision-resnet101-$i" plan --profile resnet101 --workers 64 --per-node 8 --inter 25gbit --codecs $FIVE
  run "decision-synthetic2000-$i" plan --profile profiles/validation/synthetic-2000.json \
      --workers 64 --per-node 8 --inter 25gbit --codecs $FIVE
done

# The utility study: crossover bandwidths (p3.8xlarge: 4 V100 per node), with V100 costs and
# with our CPU core's; and its communication-only model table (no compute, free codecs).
for model in resnet50 resnet101 bert-base; do
  for costs in gpu cpu; do
    flags=()
    [ $costs = gpu ] && flags=(--costs $GPU)
    run "utility-$model-$costs" utility --profile $model --workers 8,64 --per-node 4 \
        --bandwidths 1gbit,2gbit,5gbit,10gbit,25gbit --lambda $LAMBDA "${flags[@]}" \
        --codecs fp16,powersgd:rank=4,topk:ratio=0.01,signsgd
  done
done
for model in resnet50 resnet101; do
  run "utility-table-$model" utility --profile profiles/validation/$model-nocompute.json \
      --workers 8,64 --bandwidths 10gbit,25gbit --lambda 1 \
      --costs profiles/validation/codec-costs-zero.json --codecs powersgd:rank=4,topk:ratio=0.01,signsgd
done

# Plots: iteration time against bandwidth per codec, speedup against workers.
for model in resnet50 bert-base; do
  run "sweep-$model" simulate --profile $model --per-node 8 --lambda $LAMBDA --costs $GPU \
      --encode-on caller --codecs "none;fp16;powersgd:rank=4|ef;topk:ratio=0.01|ef;randomk:ratio=0.01|ef" \
      --sweep-workers 8,16,32,64 --sweep-bandwidth 1gbit,2gbit,5gbit,10gbit,25gbit,100gbit \
      --json "$OUT/sweep-$model.json"
  nice /usr/bin/python3 scripts/plot_simulation.py "$OUT/sweep-$model.json" --out docs/img/sim-$model
done
