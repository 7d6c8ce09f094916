#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
# Bootstraps .venv (CPU torch), then runs the suite (pyproject's testpaths: tests/), or only
# the paths given. Without a CUDA GPU the Triton kernels run under Triton's interpreter.
# Exits with pytest's exit code (5: no tests collected).
#
# The tests run in parallel: one pytest-xdist worker per core (at most 4), each taking whole
# files (--dist loadfile: a module's server, engine or lm-eval run is made once), handed out
# in the order collected (xdist's default, most tests first, leaves the few long server and
# engine tests for last). -n N (-n 0: none), -p no:xdist, --pdb, --trace or -s run as given.
set -euo pipefail
# shellcheck source=scripts/_bootstrap.sh
. "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export TRITON_INTERPRET=1
fi

parallel=yes
prev=
for arg in "$@"; do
    case $arg in
    -n* | --numprocesses* | -pno:xdist | --pdb | --trace | -s | --capture=no) parallel=no ;;
    no:xdist) if [ "$prev" = -p ]; then parallel=no; fi ;;
    esac
    prev=$arg
done
workers=$(python -c 'import os
cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
print(min(4, cores or 1))')
if [ "$parallel" = yes ] && [ "$workers" -gt 1 ] && python -c 'import xdist' 2>/dev/null; then
    set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
    # One torch thread per process (servers and ranks inherit it): each worker has a core,
    # and two-thread pools in every process spin against each other (-10% of the suite's
    # time on 2 cores).
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
exec python -m pytest "$@"
