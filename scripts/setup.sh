#!/usr/bin/env bash
# Installs what gradcomp needs from Debian (apt-get update only when something is missing, so
# running it again does nothing) and builds gradcomp (Release) in build/.
# Usage: scripts/setup.sh            (run as root, or with sudo available)
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  libfmt-dev nlohmann-json3-dev libcli11-dev   # formatting, JSON, the command line
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and benchmarks
  clang libclang-rt-14-dev                     # libFuzzer for the frame fuzzer
  libopenmpi-dev openmpi-bin libgloo-dev       # the transports: Open MPI and Gloo
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [[ $(id -u) -eq 0 ]] || sudo=sudo
  echo "setup: installing ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build
