#!/usr/bin/env bash
# usage: expect_rank_failure.sh VICTIM SURVIVORS COMMAND...
# Runs COMMAND (a `caravan run` of a test in which rank VICTIM dies) and passes if the launcher
# exits non-zero naming rank VICTIM as the failed rank, and each of the SURVIVORS ranks passed its
# test (they checked that they were told of the failure in time).
victim=$1 survivors=$2
shift 2
output=$("$@" 2>&1)
rc=$?
printf '%s\n' "$output"
fail() { echo "expect_rank_failure.sh: $*"; exit 1; }
[ $rc -ne 0 ] || fail "caravan run exited 0, expected a failure"
printf '%s\n' "$output" | grep -Eq "^caravan run: failed: rank $victim " || fail "caravan run did not name rank $victim"
passed=$(printf '%s\n' "$output" | grep -c '^\[  PASSED  \] 1 test\.')
[ "$passed" -eq "$survivors" ] || fail "$passed of $survivors surviving ranks passed their test"
