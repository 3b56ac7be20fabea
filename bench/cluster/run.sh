#!/usr/bin/env bash
# The emulated-cluster benchmark in one command: sets up (installs what is missing, builds),
# then runs gradcomp against PyTorch DDP and its hooks on network namespaces with tbf-limited
# links, and writes bench/cluster/results/cluster-benchmark.json, docs/cluster-benchmark.md and
# docs/img/cluster-*.png. Needs root (namespaces, tc).
# Usage: bench/cluster/run.sh [--quick] [bench.py flags...]   (--help lists them)
#        bench/cluster/run.sh --clean      removes what an aborted run left
set -euo pipefail
cd "$(dirname "$0")/../.."
if [[ $(id -u) -ne 0 ]]; then
  echo "bench/cluster: must run as root: it creates network namespaces and shapes links with" \
       "tc (try: sudo bench/cluster/run.sh $*)" >&2
  exit 1
fi
case " $* " in
  *" --help "*|*" -h "*|*" --clean "*) ;;  # nothing to build for these
  *) scripts/setup.sh ;;
esac
exec /usr/bin/python3 bench/cluster/bench.py "$@"
