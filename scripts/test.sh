#!/usr/bin/env bash
# The test command: bash scripts/test.sh [pytest args...]
# Bootstraps .venv (CPU torch), then runs the suite. Without a CUDA GPU the Triton kernels
# run under Triton's interpreter. Exits with pytest's exit code (5: no tests collected).
set -euo pipefail
# shellcheck source=scripts/_bootstrap.sh
. "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"

if ! python -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    export TRITON_INTERPRET=1
fi
exec python -m pytest tests "$@"
