#!/usr/bin/env bash
# Installs what gradcomp needs from Debian (apt-get update only when something is missing, so
# running it again does nothing) and builds gradcomp (Release) in build/.
# Usage: scripts/setup.sh [target...]   (run as root, or with sudo available)
#   no target: everything, tests included (scripts/test.sh); with targets: only those and what
#   they need (scripts/run_main.sh builds the command-line tool and the Python module only).
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config git
  libfmt-dev nlohmann-json3-dev libcli11-dev   # formatting, JSON, the command line
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and benchmarks
  clang libclang-rt-14-dev                     # libFuzzer for the frame fuzzer
  libopenmpi-dev openmpi-bin libgloo-dev       # the transports: Open MPI and Gloo
  # The PyTorch and libtorch front ends, the Fashion-MNIST data of the main job, the Python
  # side's progress bars, plots and tests. OpenBLAS replaces the reference BLAS that Debian's
  # torch uses by default (about 10x faster CPU training; it switches the system-wide
  # libblas.so.3 alternative).
  python3-dev python3-torch libtorch-dev pybind11-dev python3-numpy python3-tqdm
  python3-matplotlib python3-pytest dataset-fashion-mnist libopenblas0-pthread
  python3-torchvision                          # CNN shapes for scripts/make_profiles.py
  fortunes                                     # the language model's text (examples/language_model)
  zlib1g-dev                                   # the C++ trainer reads the gzip'd idx files
  iproute2 util-linux                          # bench/cluster: ip netns, tc; tests: setpriv
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
sudo=""
[[ $(id -u) -eq 0 ]] || sudo=sudo
if ((${#missing[@]})); then
  echo "setup: installing ${#missing[@]} Debian packages (a few minutes the first time): ${missing[*]}"
  $sudo apt-get update -qq
  # One line of progress, from apt's own status lines (APT::Status-Fd: "dlstatus:" while
  # downloading, "pmstatus:" while installing, each with its percent; dpkg's messages come in
  # bursts through a pipe). The whole log if it fails.
  log=$(mktemp)
  if ! DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
      -o APT::Status-Fd=1 "${missing[@]}" 2>&1 | tee "$log" |
      awk -F: '$1 == "dlstatus" || $1 == "pmstatus" {
                 printf "\rsetup: %s %3d%% %-50.50s", ($1 == "dlstatus" ? "downloading" : "installing"),
                        $3, $4; fflush() }
               END { print "" }'; then
    tail -n 40 "$log"
    echo "setup: apt-get install failed (the lines above say why)"
    exit 1
  fi
  rm -f "$log"
fi

echo "setup: configuring (CMake, Release, build/)"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_PYTHON=/usr/bin/python3 >/dev/null
if (($#)); then
  echo "setup: building $* (ninja shows [done/total])"
  cmake --build build --target "$@"
else
  echo "setup: building everything, tests included (ninja shows [done/total])"
  cmake --build build
fi

# `import gradcomp` for Debian's python3 (the one with torch): a .pth file naming python/.
site=$(/usr/bin/python3 -c 'import site; print(site.getsitepackages()[0])')
pth="$site/gradcomp.pth"
if [[ "$(cat "$pth" 2>/dev/null)" != "$(pwd)/python" ]]; then
  ${sudo:-} mkdir -p "$site" && echo "$(pwd)/python" | ${sudo:-} tee "$pth" >/dev/null
  echo "setup: /usr/bin/python3 imports gradcomp from $(pwd)/python ($pth)"
fi
