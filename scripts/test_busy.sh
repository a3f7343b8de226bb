#!/usr/bin/env bash
# The README's test command on a busy machine: RLPROF_BUSY_PROCESSES CPU-bound processes (default 1, a
# `while True: pass` each) run beside scripts/test.sh the whole time and are stopped when it ends, however it ends.
# The test command asserts no wall-clock figure against a fixed number (speed targets are benchmarks, retried), so it
# passes here as on a quiet machine, only slower. Arguments go to scripts/test.sh (and from there to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
busy=${RLPROF_BUSY_PROCESSES:-1}
pids=()
stop() { [ ${#pids[@]} -eq 0 ] || kill "${pids[@]}" 2>/dev/null || true; }
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP
for _ in $(seq "$busy"); do
  python3 -c 'while True: pass' &
  pids+=($!)
done
start=$SECONDS
status=0
bash scripts/test.sh "$@" || status=$?
echo "test_busy.sh: scripts/test.sh exited $status after $((SECONDS - start)) s with $busy busy processes beside it"
exit $status
