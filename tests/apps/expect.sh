#!/usr/bin/env bash
# usage: expect.sh STATUS PATTERN COMMAND...
# Runs COMMAND; passes if its exit status is STATUS (0, or "fail" for any non-zero) and its
# combined output matches the extended regular expression PATTERN.
status=$1 pattern=$2
shift 2
output=$("$@" 2>&1)
rc=$?
printf '%s\n' "$output"
if [ "$status" = fail ]; then
  [ $rc -ne 0 ] || { echo "expect.sh: expected a non-zero exit status, got 0"; exit 1; }
else
  [ $rc -eq "$status" ] || { echo "expect.sh: expected exit status $status, got $rc"; exit 1; }
fi
printf '%s\n' "$output" | grep -Eq -- "$pattern" || { echo "expect.sh: output does not match: $pattern"; exit 1; }
