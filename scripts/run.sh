#!/usr/bin/env bash
# Caravan's main job: set up from nothing, build, and run the benchmark suite on this machine.
# With no GPU it runs on the embedded CPU default (local ranks, host memories).
#   usage: scripts/run.sh [caravan arguments]     (default: bench all)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh release
if (($#)); then exec build/release/apps/caravan "$@"; fi
exec build/release/apps/caravan bench all
