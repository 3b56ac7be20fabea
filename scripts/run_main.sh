#!/usr/bin/env bash
# The main job: set up, then show what gradcomp gains on this machine: the codec benchmark
# (throughput next to memcpy), then the exchange of a 16 MB bucket through every route on 4
# processes next to the raw allreduce of the same bytes. (The distributed Fashion-MNIST
# training run replaces this once the PyTorch front end lands.)
# Extra arguments go to `gradcomp bench codecs`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/bin/gradcomp bench codecs "$@"
echo
build/bin/gradcomp bench routes -n 4 --sizes 22
