#!/usr/bin/env bash
# The server's wheels for the GPU box (no network there; the box lacks fastapi, uvicorn,
# pydantic, openai): bash scripts/box_wheels.sh  ->  .whl/serve/ (git-ignored), which
# scripts/gpu_check.sh installs into /tmp/site (carry .whl/serve with the device tool).
# The versions are the ones the CPU machines' .venv resolves; the box's Python is 3.12.
# lm-eval's wheel set is made as docs/lm_eval.md says (.whl/lmeval.tar.xz).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
py=${PYTHON:-.venv/bin/python}
mkdir -p .whl/serve
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform any \
    -d .whl/serve \
    fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic_core==2.50.5 starlette==1.10.0 \
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 jiter==0.19.0 sniffio==1.3.1 \
    typing-inspection==0.4.5 annotated-types==0.8.0 distro truststore opentelemetry-api
ls .whl/serve
