#!/bin/bash
# Accuracy through the routes over nodes (docs/node-routes.md): 4 ranks in nodes of 2, seed 0,
# the accuracy tables' settings: Fashion-MNIST under SGD (5 epochs) and the language model under
# AdamW (400 steps). Each run's summary goes to docs/data/node-routes/, its log to build/.
set -euo pipefail
cd "$(dirname "$0")/.."
L=build/bin/gradcomp
OUT=docs/data/node-routes
mkdir -p "$OUT" build
fm() {
  local name=$1; shift
  $L launch -n 4 -- /usr/bin/python3 examples/fashion_mnist/train.py --epochs 5 --no-progress \
      --json "$OUT/fm-$name.json" "$@" > "build/node-routes-fm-$name.log" 2>&1
  echo "fm-$name done"
}
lm() {
  local name=$1; shift
  $L launch -n 4 -- /usr/bin/python3 examples/language_model/train.py --steps 400 --batch-size 8 \
      --optimizer adamw --seed 0 --no-progress --json "$OUT/lm-$name.json" "$@" \
      > "build/node-routes-lm-$name.log" 2>&1
  echo "lm-$name done"
}
fm topk-sharded --compression 'topk:ratio=0.01|ef|sharded:inner=allgather' --local-size 2
fm topk-leader --compression 'topk:ratio=0.01|ef|hierarchical:inner=allgather' --local-size 2
fm qsgd-sharded --compression 'qsgd:levels=15,block=512|none|sharded:inner=allgather' --local-size 2
fm none-sharded --compression 'none|none|sharded' --local-size 2
lm none --compression none
lm qsgd --compression 'qsgd:levels=15,block=512'
lm qsgd-sharded --compression 'qsgd:levels=15,block=512|none|sharded:inner=allgather' --local-size 2
lm fp16 --compression fp16
lm fp16-sharded --compression 'fp16|none|sharded:inner=allreduce,intra=fp16' --local-size 2
