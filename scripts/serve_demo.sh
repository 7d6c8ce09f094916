#!/usr/bin/env bash
# The server's demo: bash scripts/serve_demo.sh [--max-tokens N] [--prompt TEXT] [--model DIR]
# Bootstraps .venv (CPU torch), starts `vllm serve` (a tiny random Mamba2 with a real
# tokenizer on the CPU; the Codestral-7B shape with random weights on a GPU), streams one
# completion over HTTP and prints it as it comes, then stops the server with SIGTERM
# (examples/serve_demo.py).
set -euo pipefail
# shellcheck source=scripts/_bootstrap.sh
. "$(dirname "${BASH_SOURCE[0]}")/_bootstrap.sh"
exec python -m examples.serve_demo "$@"
