#!/usr/bin/env bash
# The main job for now: bash scripts/demo.sh [--json PATH] [--reps N]
# Bootstraps .venv (CPU torch), then checks and times the causal-conv1d ops
# (examples/causal_conv1d_demo.py; without a GPU it uses the Triton interpreter itself).
set -euo pipefail
# shellcheck source=scripts/_bootstrap.sh
. "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
exec python examples/causal_conv1d_demo.py "$@"
