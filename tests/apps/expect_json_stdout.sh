#!/usr/bin/env bash
# usage: expect_json_stdout.sh PATTERN COMMAND...
# Runs COMMAND (a `caravan bench ... --json` with no FILE); passes if it exits 0 and its standard
# output is JSON alone: it starts with '{', ends with '}', holds no table ('== caravan bench'),
# and matches the extended regular expression PATTERN. Standard error (progress) is shown, not
# checked.
pattern=$1
shift
stdout=$("$@")
rc=$?
printf '%s\n' "$stdout"
[ $rc -eq 0 ] || { echo "expect_json_stdout.sh: expected exit status 0, got $rc"; exit 1; }
trimmed=$(printf '%s' "$stdout" | tr -d ' \n\t\r')
case "$trimmed" in
  '{'*'}') ;;
  *) echo "expect_json_stdout.sh: standard output is not one JSON object"; exit 1 ;;
esac
case "$stdout" in
  *'== caravan bench'*) echo "expect_json_stdout.sh: tables on standard output besides the JSON"; exit 1 ;;
esac
printf '%s\n' "$stdout" | grep -Eq -- "$pattern" || { echo "expect_json_stdout.sh: output does not match: $pattern"; exit 1; }
