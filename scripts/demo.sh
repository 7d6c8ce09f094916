#!/usr/bin/env bash
# The main job: bash scripts/demo.sh [--max-tokens N] [--prompt TEXT] [--json PATH]
# Bootstraps .venv (CPU torch), then generates a few tokens through vllm.LLM
# (examples/generate_demo.py: a tiny random-weight Mamba2 on the CPU, the Codestral-7B
# shape with random weights on a GPU) and prints the text, the token ids and tokens/s.
# bash scripts/demo.sh --conv [--json PATH] [--reps N] checks and times the causal-conv1d
# ops instead (examples/causal_conv1d_demo.py).
set -euo pipefail
# shellcheck source=scripts/_bootstrap.sh
. "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
if [ "${1:-}" = "--conv" ]; then
    shift
    exec python examples/causal_conv1d_demo.py "$@"
fi
exec python examples/generate_demo.py "$@"
