#!/usr/bin/env bash
# The main job: set up, then run the codec benchmark and print its table (until the training
# front end lands, this is what gradcomp shows). Extra arguments go to `gradcomp bench codecs`.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
build/bin/gradcomp bench codecs "$@"
