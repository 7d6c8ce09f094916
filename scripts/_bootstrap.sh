# shellcheck shell=bash
# Sourced by scripts/test.sh and scripts/demo.sh (not run on its own), which run under
# `set -euo pipefail`: make sure the repo's .venv exists and holds the CPU requirements,
# the test tools and this package (editable), then activate it and leave the shell in the
# repo root.
#
# torch is installed first, alone and pinned: on these machines `pip install
# torch==2.13.0` takes a CPU wheel already on disk, while a bare `torch` asked for by any
# later package would pull a CUDA build of several GB. The installs run again only when
# requirements/, setup.py or pyproject.toml change (a stamp in .venv remembers them).

cd "$(dirname "${BASH_SOURCE[0]}")/.." || return 1

if [ ! -x .venv/bin/python ]; then
    echo "bootstrap: creating .venv" >&2
    "${PYTHON:-python3}" -m venv .venv
fi

_stamp=.venv/.vllm-bootstrap
_wanted=$(cat requirements/*.txt setup.py pyproject.toml | sha256sum)
if [ "$(cat "$_stamp" 2>/dev/null)" != "$_wanted" ]; then
    echo "bootstrap: installing torch==2.13.0, requirements/cpu.txt, test.txt and vllm (-e)" >&2
    .venv/bin/python -m pip install -q torch==2.13.0
    .venv/bin/python -m pip install -q -r requirements/cpu.txt -r requirements/test.txt
    .venv/bin/python -m pip install -q --no-deps -e .
    echo "$_wanted" >"$_stamp"
fi
unset _stamp _wanted

# shellcheck disable=SC1091
. .venv/bin/activate
