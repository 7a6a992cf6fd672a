#!/usr/bin/env bash
# Installs Caravan's build dependencies (Debian 12 packages) and builds one CMake preset.
# Quick when everything is already there: apt-get runs only for packages that are missing,
# and the build is incremental.
#   usage: scripts/setup.sh [PRESET [cmake --build arguments]]
#          PRESET: release (default), debug, asan, tsan; e.g. scripts/setup.sh tsan --target dma_tests
set -euo pipefail
cd "$(dirname "$0")/.."
preset=${1:-release}
(($#)) && shift

packages=(build-essential cmake ninja-build pkg-config
          libboost-graph-dev libucx-dev ucx-utils libspdlog-dev libfmt-dev
          nlohmann-json3-dev libcli11-dev libhwloc-dev libgtest-dev libgmock-dev)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "caravan setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# nvcc is optional: when the CUDA toolkit is installed, GPU sources are built too.
[ -x /usr/local/cuda/bin/nvcc ] && export PATH="/usr/local/cuda/bin:$PATH"

cmake --preset "$preset" >/dev/null
cmake --build --preset "$preset" "$@"
