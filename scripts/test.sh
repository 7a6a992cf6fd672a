#!/usr/bin/env bash
# Sets up from nothing, builds, and runs the test suite.
#   usage: scripts/test.sh [PRESET] [ctest arguments]   (PRESET: release (default), debug, asan, tsan)
set -euo pipefail
cd "$(dirname "$0")/.."
preset=release
case "${1:-}" in release|debug|asan|tsan) preset=$1; shift ;; esac
scripts/setup.sh "$preset"
ctest --preset "$preset" -j2 "$@"
