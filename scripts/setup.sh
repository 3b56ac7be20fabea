#!/usr/bin/env bash
# Installs what gradcomp needs from Debian (apt-get update only when something is missing, so
# running it again does nothing) and builds gradcomp (Release) in build/.
# Usage: scripts/setup.sh [target...]   (run as root, or with sudo available)
#   no target: every package and everything, tests included (scripts/test.sh); with targets:
#   the packages those need and only them (scripts/run_main.sh: the command-line tool and the
#   Python module), so a first main job does not wait for the test tools to install and build.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the library, the command-line tool and the Python module need, and the main job's data.
packages=(
  build-essential cmake ninja-build pkg-config
  libfmt-dev nlohmann-json3-dev libcli11-dev   # formatting, JSON, the command line
  libopenmpi-dev openmpi-bin libgloo-dev       # the transports: Open MPI and Gloo
  # The PyTorch and libtorch front ends, the Fashion-MNIST data of the main job, the Python
  # side's progress bars. OpenBLAS replaces the reference BLAS that Debian's torch uses by
  # default (about 10x faster CPU training; it switches the system-wide libblas.so.3
  # alternative).
  python3-dev python3-torch libtorch-dev pybind11-dev python3-numpy python3-tqdm
  dataset-fashion-mnist libopenblas0-pthread
  zlib1g-dev                                   # the C++ trainer reads the gzip'd idx files
)
# What the tests, the fuzzers and the scripts around them add.
test_packages=(
  git
  libgtest-dev libgmock-dev libbenchmark-dev   # tests and benchmarks
  clang libclang-rt-14-dev libomp-dev          # the ASan + fuzzer tree: clang, libFuzzer, OpenMP
  python3-matplotlib python3-pytest            # plots, the Python tests
  python3-torchvision                          # CNN shapes for scripts/make_profiles.py
  fortunes                                     # the language model's text (examples/language_model)
  iproute2 util-linux                          # bench/cluster: ip netns, tc; tests: setpriv
)
installed() { dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"; }
# The tests are configured when their packages are there: always for everything, and for
# targets once the test command has installed them (so the main job keeps them configured).
tests=ON
if (($#)); then
  for p in "${test_packages[@]}"; do installed "$p" || tests=OFF; done
else
  packages+=("${test_packages[@]}")
fi

missing=()
for p in "${packages[@]}"; do
  installed "$p" || missing+=("$p")
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
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGRADCOMP_PYTHON=/usr/bin/python3 \
  -DGRADCOMP_TESTS=$tests >/dev/null
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
