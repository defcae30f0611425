#!/usr/bin/env bash
# make test (what .ci/run calls): the suite in two pytest sessions side by side on a 2-core machine.
#   slow: every test marked `slow` or `vllm`, one at a time, in order, printed as it runs. Each starts
#         vLLM engines, learners or whole runs that use both cores, and its deadlines were set for that.
#   fast: the ~840 others (each about one core or less), beside the slow ones; its output is printed
#         after them. Measured in docs/running.md ("Tests").
# Exits non-zero when either session fails. Extra arguments go to both pytest sessions; with them, a
# session the filter leaves no test in (pytest's rc 5) has not failed, unless the other has none either.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
tmp=$(mktemp -d)
fast=""
trap '[ -n "$fast" ] && kill "$fast" 2>/dev/null; rm -rf "$tmp"' EXIT
# own temporary folders, and one cache writer: the two sessions never touch each other's files
"$PY" -m pytest -m "not gpu and not slow and not vllm" -q -p no:cacheprovider --basetemp "$tmp/fast" \
  --durations=5 "$@" > "$tmp/fast.log" 2>&1 &
fast=$!
"$PY" -m pytest -m "not gpu and (slow or vllm)" -q --basetemp "$tmp/slow" --durations=20 "$@"
slow_rc=$?
wait "$fast"
fast_rc=$?
echo "---------------------------- the fast tests (run beside the slow ones) ----------------------------"
cat "$tmp/fast.log"
echo "[test] slow tests: rc $slow_rc; fast tests: rc $fast_rc"
nargs=$#
passed() { [ "$1" = 0 ] || { [ "$1" = 5 ] && [ "$nargs" -gt 0 ]; }; }  # 5: the filter selected none here
passed "$slow_rc" && passed "$fast_rc" && [ "$slow_rc$fast_rc" != 55 ]
