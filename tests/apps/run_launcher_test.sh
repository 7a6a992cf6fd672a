#!/usr/bin/env bash
# usage: run_launcher_test.sh CARAVAN
# `caravan run` as a job's owner meets it: a program that cannot start, processes a rank leaves
# behind, a stop signal to the launcher, and a segment the job leaves in /dev/shm. Each case checks the exit status, the launcher's
# words, and that nothing of the job is left running.
set -u
caravan=$1
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
failed=0
fail() { echo "run_launcher_test: $*"; failed=1; }
marker="caravan-launcher-test-$$"
naptime="299.$$"  # a sleep of the job, told apart from any other by its length

# 1. A program that is not on PATH: refused with the reason, before any rank runs.
out=$("$caravan" run -n 2 "$marker-no-such-program" 2>&1)
rc=$?
[ $rc -eq 2 ] || fail "missing program: exit status $rc, expected 2"
grep -q "cannot start $marker-no-such-program: No such file or directory" <<<"$out" || fail "missing program: said: $out"

# 2. A rank leaves a process running and another fails: the leftover is stopped at the end.
cat >"$dir/leaves.sh" <<SCRIPT
#!/bin/sh
if [ "\$RANK" = 0 ]; then sleep 1; exit 3; fi
sleep $naptime &
sleep $naptime
SCRIPT
chmod +x "$dir/leaves.sh"
out=$("$caravan" run -n 2 --grace 0 "$dir/leaves.sh" 2>&1)
rc=$?
[ $rc -eq 3 ] || fail "leftover: exit status $rc, expected rank 0's 3"
grep -q "process(es) the ranks had started and left running" <<<"$out" || fail "leftover: not reported: $out"
grep -q "1 of 2 rank(s) failed; 1 stopped by the launcher" <<<"$out" || fail "leftover: summary: $out"
sleep 0.2
pgrep -f "sleep $naptime" >/dev/null && fail "leftover: a process of the job is still running"

# 3. SIGTERM to the launcher: passed on to every rank (their handlers run), then 128 + 15.
cat >"$dir/handles.sh" <<'SCRIPT'
#!/bin/sh
trap 'echo "handled on rank $RANK"; exit 0' TERM
sleep 300 &
wait
SCRIPT
chmod +x "$dir/handles.sh"
"$caravan" run -n 2 "$dir/handles.sh" >"$dir/out" 2>&1 &
launcher=$!
sleep 1.5
kill -TERM $launcher
wait $launcher
rc=$?
[ $rc -eq 143 ] || fail "signal: exit status $rc, expected 143"
[ "$(grep -c 'handled on rank' "$dir/out")" -eq 2 ] || fail "signal: not every rank's handler ran: $(cat "$dir/out")"
grep -q "stopped by signal 15" "$dir/out" || fail "signal: not reported: $(cat "$dir/out")"

# 4. A segment the job leaves in /dev/shm (as a rank killed while it makes the heap would): the
# launcher removes it by the job id it gave the ranks (CARAVAN_JOB_ID).
cat >"$dir/segment.sh" <<'SCRIPT'
#!/bin/sh
[ -n "$CARAVAN_JOB_ID" ] || { echo "no CARAVAN_JOB_ID"; exit 1; }
echo "$CARAVAN_JOB_ID" >"$1"
touch "/dev/shm/caravan-$CARAVAN_JOB_ID-node0"
SCRIPT
chmod +x "$dir/segment.sh"
if [ -d /dev/shm ] && [ -w /dev/shm ]; then
  out=$("$caravan" run -n 1 "$dir/segment.sh" "$dir/job" 2>&1)
  rc=$?
  [ $rc -eq 0 ] || fail "segment: exit status $rc: $out"
  grep -q "removed 1 shared-memory segment(s)" <<<"$out" || fail "segment: not reported: $out"
  [ -e "/dev/shm/caravan-$(cat "$dir/job")-node0" ] && fail "segment: still in /dev/shm"
else
  echo "run_launcher_test: case 4 skipped: /dev/shm is not writable here"
fi

cat "$dir/out"
exit $failed
