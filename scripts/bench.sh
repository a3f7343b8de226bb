#!/usr/bin/env bash
# Regression runs with pytest-benchmark, on one machine:
#   scripts/bench.sh save NAME [PYTEST ARGS...]                    run the benchmarks and keep them as NAME
#   scripts/bench.sh compare NAME [--fail-above R] [PYTEST ARGS...]  run them again, compare with NAME (rlprof
#                                                                  compare); exit 1 on a regression beyond R (1.2)
# PYTEST ARGS default to this repository's benchmarks/; give your own test paths to benchmark your code (tests that
# use the rlprof_benchmark fixture also say which rlprof role slowed). Runs are kept under $RLPROF_BENCH_STORAGE
# (default .benchmarks in the current folder), one subfolder per machine, as pytest-benchmark keeps them.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
python="$root/.venv/bin/python"
[ -x "$python" ] || python=python
storage="${RLPROF_BENCH_STORAGE:-.benchmarks}"
usage="usage: scripts/bench.sh save NAME [PYTEST ARGS...] | compare NAME [--fail-above R] [PYTEST ARGS...]"

action="${1:-}"
name="${2:-}"
if [ -z "$name" ] || { [ "$action" != save ] && [ "$action" != compare ]; }; then
    echo "$usage" >&2
    exit 2
fi
shift 2
if ! [[ "$name" =~ ^[A-Za-z0-9_.-]+$ ]]; then
    echo "scripts/bench.sh: NAME '$name' may hold only letters, digits, '.', '_' and '-'" >&2
    exit 2
fi
fail_above=1.2
if [ "${1:-}" = --fail-above ]; then
    fail_above="${2:?--fail-above needs a ratio, e.g. 1.2}"
    shift 2
fi
[ $# -gt 0 ] || set -- "$root/benchmarks"

saved() {  # the newest run saved as NAME, on any machine folder
    { ls -t "$storage"/*/[0-9][0-9][0-9][0-9]_"$1".json 2>/dev/null || true; } | head -n 1
}

run_benchmarks() {  # pytest-benchmark with the rounds kept (for intervals), saved as $1
    "$python" -m pytest -p no:cacheprovider -q --benchmark-only --benchmark-save-data \
        --benchmark-storage="file://$storage" --benchmark-save="$1" "${@:2}"
}

if [ "$action" = save ]; then
    run_benchmarks "$name" "$@"
    echo "saved as $(saved "$name")"
    exit 0
fi
baseline="$(saved "$name")"
if [ -z "$baseline" ]; then
    echo "scripts/bench.sh: no run saved as '$name' under $storage (run: scripts/bench.sh save $name)" >&2
    exit 2
fi
current="vs-$name"
run_benchmarks "$current" "$@"
exec "$python" -m rlprof.cli compare "$baseline" "$(saved "$current")" --fail-above "$fail_above"
