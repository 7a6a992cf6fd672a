#!/usr/bin/env bash
# usage: check_downstream.sh BUILD_DIR DOWNSTREAM_SOURCE SCRATCH_DIR [SANITIZER_FLAGS]
# Installs BUILD_DIR into a scratch prefix, then configures, builds and runs the downstream
# project against it. SANITIZER_FLAGS: what a sanitizer build's libraries need their consumer to
# compile and link with (their code calls the sanitizer's runtime). A step's output is shown
# only when it fails.
set -euo pipefail
build=$1 source=$2 scratch=$3 flags=${4:-}
rm -rf "$scratch"
mkdir -p "$scratch"
log="$scratch/log"
step() {
  "$@" >"$log" 2>&1 || { cat "$log"; echo "check_downstream.sh: failed: $*"; exit 1; }
}
step cmake --install "$build" --prefix "$scratch/prefix"
step cmake -S "$source" -B "$scratch/build" -G Ninja -DCMAKE_PREFIX_PATH="$scratch/prefix" -DCMAKE_BUILD_TYPE=Release \
  "-DCMAKE_CXX_FLAGS=$flags" "-DCMAKE_EXE_LINKER_FLAGS=$flags"
step cmake --build "$scratch/build"
"$scratch/build/downstream"
