#!/usr/bin/env bash
# The GPU box's check: bash scripts/gpu_check.sh OUTDIR
# For a machine with torch, triton, transformers and pytest preinstalled and no network:
# installs this package without touching those, building the CUDA ops of csrc/ (falling
# back to a pure Python install if that build fails), runs the GPU tests, the rest of the
# suite (on CUDA tensors where a test's device fixture picks CUDA), the demo and the
# benchmarks (results under OUTDIR). Every step runs even
# when an earlier one failed; the exit code is non-zero if any step failed.
# Steps on request only (GPU_CHECK_STEPS): wheels, ssd_bench, replay_bench, selective_scan_bench,
# fused_moe_bench, vs_hf, cold_start, e2e,
# e2e_cold_warm, serve, host_cost, lm_eval, hybrid_bench, serving_sweep, tp (see below).
# Also on request: vs_hf_arch (issues 33/34's four shapes against HF; see below).
set -uo pipefail
export PYTHONUNBUFFERED=1
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

failed=()
step() { # step NAME COMMAND...: run it, remember a failure, carry on
    local name=$1
    shift
    "$@" || failed+=("$name (exit $?)")
}

environment() {
    nvidia-smi
    python3 -c 'import sys, torch, triton
print("python", sys.version.split()[0])
print("torch", torch.__version__, "cuda", torch.version.cuda)
print("triton", triton.__version__)'
    echo "git $(git rev-parse --verify -q HEAD || echo 'unknown (no .git or no commit)')"
}
install() {
    # GPU_CHECK_PREBUILT=1: a vllm/_C_conv*.so carried in from an earlier build is used
    # as it is (the box starts bare on every call, and the CUDA build takes minutes).
    # GPU_CHECK_CUDA_OPS=0: no CUDA build at all (the CUDA-pathway tests then skip, saying
    # so): for calls whose time goes to the Triton side.
    if [ "${GPU_CHECK_CUDA_OPS:-1}" = 0 ]; then
        VLLM_BUILD_CUDA_OPS=0 python3 -m pip install --no-deps --no-build-isolation -e . \
            >"$out/install.log" 2>&1 || return 1
        echo "CUDA ops available: False (GPU_CHECK_CUDA_OPS=0)" | tee -a "$out/install.log"
        return
    fi
    if [ "${GPU_CHECK_PREBUILT:-0}" = 1 ] && ls vllm/_C_conv*.so >/dev/null 2>&1; then
        VLLM_BUILD_CUDA_OPS=0 python3 -m pip install --no-deps --no-build-isolation -e . \
            >"$out/install.log" 2>&1 || return 1
        python3 -c 'import sys, vllm._custom_ops as o
ok = o.cuda_ops_available()
print("CUDA ops available:", ok, "(prebuilt)")
sys.exit(0 if ok else 1)' 2>&1 | tee -a "$out/install.log"
        return
    fi
    if VLLM_BUILD_CUDA_OPS=1 python3 -m pip install -v --no-deps --no-build-isolation -e . \
        >"$out/install.log" 2>&1; then
        python3 -c 'import sys, vllm._custom_ops as o
ok = o.cuda_ops_available()
print("CUDA ops available:", ok)
sys.exit(0 if ok else 1)' 2>&1 | tee -a "$out/install.log"
    else
        echo "install with the CUDA ops failed (install.log); installing without them" |
            tee -a "$out/install.log"
        VLLM_BUILD_CUDA_OPS=0 python3 -m pip install --no-deps --no-build-isolation -e . \
            >>"$out/install.log" 2>&1
        return 1
    fi
}
# pytest-xdist, when the box has it, spreads the tests (mostly Triton compiles) over cores.
parallel=$(python3 -c 'import xdist' 2>/dev/null && echo "-n 8")
gpu_tests() {
    # tests/entrypoints import the server's packages at collection (carried as wheels).
    serve_wheels "$out/serve_wheels.log" || echo "(tests/entrypoints will fail to import)"
    # GPU_TEST_PATHS narrows the run (default: the whole suite's GPU tests). Figures the
    # tests record (the hybrids' bf16 errors against HF) go to test_records.txt.
    : >"$out/test_records.txt"
    # shellcheck disable=SC2086
    VLLM_TEST_RECORD="$out/test_records.txt" python3 -m pytest ${GPU_TEST_PATHS:-tests} -m gpu $parallel -q -p no:cacheprovider --durations=12 --junitxml "$out/gpu_tests.xml" 2>&1 |
        tee "$out/tests.log"
}
other_tests() {
    # The server tests (tests/entrypoints) need the server's packages: carried as wheels.
    serve_wheels "$out/serve_wheels.log" || echo "(the server tests will fail to import)"
    python3 -m pytest tests -q -m "not gpu" $parallel -p no:cacheprovider 2>&1 | tee -a "$out/tests.log"
}
demo() {
    python3 examples/causal_conv1d_demo.py --json "$out/demo.json" 2>&1 | tee "$out/demo.log" &&
        python3 examples/generate_demo.py --json "$out/generate.json" 2>&1 | tee -a "$out/demo.log"
}
# The benchmarks of record (docs/benchmarks/): every kernel case (~1 minute), one 7B-shaped
# step per conv backend (~2 minutes), and, only when asked for (GPU_CHECK_STEPS=e2e; ~4
# minutes), the end-to-end comparison.
bench() {
    python3 -m benchmarks.kernels.benchmark_causal_conv1d --out "$out/bench" 2>&1 |
        tee "$out/bench.log"
}
# Host cost per eager call of the conv ops and the metadata builder (issue 14; ~1 minute):
# the table against the targets, the pieces of one call and a cProfile of each case.
host_cost() {
    python3 -m benchmarks.kernels.benchmark_conv_host_cost --profile --out "$out/host_cost.json" \
        --md "$out/host_cost.md" 2>&1 | tee "$out/host_cost.log"
}
# One Mamba2 step per kind and backend, profiled (STEP_BENCH_ARGS adds options, e.g.
# "--backends triton --num-decodes 63 --prefill-len 1024 --decode-batch 64 --no-cuda-graph").
step_bench() {
    python3 -m benchmarks.engine.benchmark_mamba2_step --profile ${STEP_BENCH_ARGS:-} \
        --out "$out/step.json" 2>&1 | tee "$out/step.log"
}
e2e() {
    python3 -m benchmarks.engine.benchmark_e2e --num-prompts 200 --profile --out "$out/e2e.json" \
        --md "$out/e2e_h200.md" 2>&1 | tee "$out/e2e.log"
}
# Cold against warm Triton cache, each conv backend (the CUDA one when its ops are built),
# 100 synthetic prompts x 256 output tokens: each run twice on one cache folder, empty then
# filled by the first run (~3 minutes).
e2e_cold_warm() {
    python3 -m benchmarks.engine.benchmark_e2e --backends triton,cuda --output-lens 256 --cold-warm \
        --budget-s 0 --out "$out/e2e_cold_warm.json" --md "$out/e2e_cold_warm.md" 2>&1 |
        tee "$out/e2e_cold_warm.log"
}
# The pure-Python mamba_ssm wheel (and einops) built on the development machine and
# carried in as .whl/ (the device tool's carry): installed into /tmp/site, put on
# PYTHONPATH for the steps after it (mamba_ssm's Triton ops; benchmarks/common/mamba_ssm_import.py
# imports them without the package __init__, which wants CUDA extensions). Not in a pipe:
# the export must reach this shell. ssd_bench and vs_hf run it themselves when needed.
wheels_done=0
wheels() {
    [ "$wheels_done" = 1 ] && return 0
    if ! ls .whl/*.whl >/dev/null 2>&1; then
        echo "no .whl/*.whl in the tree: mamba_ssm not installed" >"$out/wheels.log"
        cat "$out/wheels.log"
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl >"$out/wheels.log" 2>&1 || { cat "$out/wheels.log"; return 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    wheels_done=1
    python3 -m benchmarks.common.mamba_ssm_import >>"$out/wheels.log" 2>&1
    local rc=$?
    tail -n 1 "$out/wheels.log"
    return $rc
}
# Replayed decode (docs/replayssm.md): the kernel table against upstream 0.33's kernels when
# a carried .upstream/ holds them (~1 minute), then the CUDA-graph decode step at batch 128,
# fp32 and bf16 state, replay on and off (~2 minutes). REPLAY_BENCH_ARGS adds kernel options.
replay_bench() {
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    [ -d .upstream ] && path="$path:$PWD/.upstream"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.benchmark_replayssm ${REPLAY_BENCH_ARGS:-} \
        --out "$out/replay" 2>&1 | tee "$out/replay.log"
    local dtype flag
    for dtype in float32 bfloat16; do
        for flag in --use-replayssm --no-use-replayssm; do
            python3 -m benchmarks.engine.benchmark_mamba2_step --backends triton --decode-batch 128 \
                --num-decodes 127 --iters 16 --mamba-ssm-cache-dtype $dtype $flag \
                --out "$out/replay/step_${dtype}${flag}.json" 2>&1 | tee -a "$out/replay_step.log"
        done
    done
}
# The SSD op benchmark (ours Triton and PyTorch, mamba_ssm): ~2 minutes.
ssd_bench() {
    wheels || echo "(mamba_ssm providers will say why they did not run)"
    # Upstream 0.33's SSD from a carried .upstream/ (docs/gpu_box.md); absent: skipped, saying so.
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    [ -d .upstream ] && path="$path:$PWD/.upstream"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.benchmark_ssd ${SSD_BENCH_ARGS:-} \
        --out "$out/ssd" 2>&1 | tee "$out/ssd.log"
}
# Mamba1's selective scan at falcon-mamba-7b's layer shape (docs/selective_scan.md): ours
# against transformers' PyTorch scan and the byte floor, prefill 1 x 8192 and 16 x 512 with
# initial states, decode 1/32/128, fp32 and bf16 pools; ~1-2 minutes. SCAN_BENCH_ARGS adds options.
selective_scan_bench() {
    # shellcheck disable=SC2086
    python3 -m benchmarks.kernels.benchmark_selective_scan ${SCAN_BENCH_ARGS:-} \
        --out "$out/selective_scan" 2>&1 | tee "$out/selective_scan.log"
}
# The fused-MoE op (docs/fused_moe.md) on the Granite-4.0-H-Small and Nemotron-3-Nano layer
# shapes at 1-4096 tokens: ours, upstream 0.33's Triton kernel from a carried .upstream/
# (absent: skipped, saying so), a per-expert PyTorch loop; ~2 minutes. MOE_BENCH_ARGS adds options.
fused_moe_bench() {
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    [ -d .upstream ] && path="$path:$PWD/.upstream"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.benchmark_fused_moe ${MOE_BENCH_ARGS:-} \
        --out "$out/fused_moe" 2>&1 | tee "$out/fused_moe.log"
}
# Ours (max_num_batched_tokens 2048 and 8192, fp32 state; 8192 with bf16 state) and HF
# generate with mamba_ssm's Triton kernels: 128 prompts x 512 tokens, 256 output tokens,
# and a 1-token run of the same prompts for prefill tok/s; ~5-6 minutes.
vs_hf() {
    wheels || echo "(HF runs without mamba_ssm: its PyTorch scan)"
    python3 -m benchmarks.engine.benchmark_vs_hf --out "$out/vs_hf.json" --md "$out/vs_hf.md" 2>&1 |
        tee "$out/vs_hf.log"
}
cold_start() {
    python3 -m pytest tests/engine/test_cold_start.py -q -p no:cacheprovider 2>&1 |
        tee "$out/cold_start.log"
}

# Issues 33/34: the falcon-mamba-7b, LFM2-1.2B, Granite-4.0-H-Tiny and Nemotron-3-Nano shapes
# (random bf16 weights), ours against HF generate of the same architecture in the same run:
# 128 prompts x 512 tokens, 256 output tokens, --prefill-run, one benchmark_vs_hf.py per
# shape (VS_HF_ARCH_MODELS picks some: the four may not fit one 10-minute call). HF's
# PyTorch Mamba1 scan holds three fp32 (batch, 8192, 512, 16) tensors per falcon-mamba-7b
# layer (~103 GB at batch 128, ~52 GB at 64): its prompts go in batches of
# VS_HF_ARCH_FALCON_HF_BATCH (64; the table records it).
vs_hf_arch() {
    wheels || echo "(HF's Mamba2-family models run without mamba_ssm: its PyTorch scan)"
    local m hf_batch rc=0
    for m in ${VS_HF_ARCH_MODELS:-falcon-mamba-7b lfm2-1.2b granite-4.0-h-tiny nemotron-3-nano}; do
        hf_batch=""
        [ "$m" = falcon-mamba-7b ] && hf_batch="--hf-batch-size ${VS_HF_ARCH_FALCON_HF_BATCH:-64}"
        # shellcheck disable=SC2086
        python3 -m benchmarks.engine.benchmark_vs_hf --model "$m" \
            --systems "${VS_HF_ARCH_SYSTEMS:-ours-8192-fp32,hf}" --max-model-len 768 \
            --timeout-s "${VS_HF_ARCH_TIMEOUT_S:-420}" $hf_batch ${VS_HF_ARCH_ARGS:-} \
            --out "$out/vs_hf_$m.json" --md "$out/vs_hf_$m.md" 2>&1 | tee "$out/vs_hf_$m.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
    return $rc
}

# `vllm serve` on the Codestral-7B shape (random bf16 weights: --load-format dummy reads
# only config.json): one streaming completion through the openai client and one over raw
# HTTP (time to first chunk, the chunks, tokens/s), then SIGTERM, which must end the
# server with status 0; ~1-2 minutes. The server's packages travel as wheels in
# .whl/serve/ (the device tool's carry; the box has no network and lacks them): installed
# into /tmp/site and put on PYTHONPATH for the steps after it (so `serve` before
# `other_tests` lets the suite's server tests import them). Not in a pipe, as `wheels`.
serve_wheels_done=0
serve_wheels() { # serve_wheels LOG: the server's wheels into /tmp/site, once
    [ "$serve_wheels_done" = 1 ] && return 0
    if ! ls .whl/serve/*.whl >/dev/null 2>&1; then
        echo "serve: no .whl/serve/*.whl in the tree (make it: bash scripts/box_wheels.sh; carry .whl/serve)" | tee -a "$1"
        return 1
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
        --target /tmp/site .whl/serve/*.whl >>"$1" 2>&1 || { cat "$1"; return 1; }
    export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    serve_wheels_done=1
}
serve() {
    local log="$out/serve.log" dir=/tmp/serve_codestral port=8321 pid rc client_rc
    : >"$log"
    serve_wheels "$log" || return 1
    # The box's own packages the server relies on, with the versions the wheels need.
    python3 -c 'import importlib.metadata as m
for name, need in (("anyio", "4.10"), ("typing_extensions", "4.16"), ("idna", "3.18"),
                   ("h11", "0.16"), ("click", "7.0"), ("annotated-doc", "0.0.2"),
                   ("prometheus_client", "any"), ("httpx", "any")):
    print(f"serve: box has {name} {m.version(name)} (needs >= {need})")' 2>&1 | tee -a "$log"
    python3 - "$dir" >>"$log" 2>&1 <<'PY' || { cat "$log"; return 1; }
import dataclasses, json, pathlib, sys
from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig
d = pathlib.Path(sys.argv[1])
d.mkdir(parents=True, exist_ok=True)
config = {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"}
config.update({k: v for k, v in dataclasses.asdict(Mamba2ModelConfig()).items() if v is not None})
(d / "config.json").write_text(json.dumps(config, indent=2))  # inf as Infinity, as HF writes it
PY
    local cmd=(python3 -m vllm.entrypoints.cli.main)
    command -v vllm >/dev/null && cmd=(vllm)  # the console script, once `install` made it
    echo "serve: ${cmd[*]} serve $dir --load-format dummy --dtype bfloat16" | tee -a "$log"
    "${cmd[@]}" serve "$dir" --load-format dummy --dtype bfloat16 --host 127.0.0.1 \
        --port "$port" >"$out/serve_server.log" 2>&1 &
    pid=$!
    python3 - "$port" "$pid" <<'PY' 2>&1 | tee -a "$log"
import http.client, json, os, sys, time, urllib.request
port, pid = int(sys.argv[1]), int(sys.argv[2])
base, start = f"http://127.0.0.1:{port}", time.monotonic()
while True:
    try:
        if urllib.request.urlopen(base + "/health", timeout=2).status == 200:
            break
    except OSError:
        pass
    try:
        os.kill(pid, 0)
    except OSError:
        sys.exit("serve: the server exited during start-up (serve_server.log)")
    if time.monotonic() - start > 600:
        sys.exit("serve: no answer on /health in 600 s (serve_server.log)")
    time.sleep(0.5)
print(f"serve: /health answered {time.monotonic() - start:.1f} s after the start")
body = {"prompt": "Mamba2 on an H200", "max_tokens": 128, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

def report(how, t0, arrivals, texts, tokens):
    end = arrivals[-1]
    print(f"serve: {how}: first chunk {1e3 * (arrivals[0] - t0):.1f} ms, {len(texts)} chunks, "
          f"{tokens} tokens in {end - t0:.2f} s = {tokens / (end - t0):.1f} tok/s "
          f"({(tokens - 1) / max(end - arrivals[0], 1e-9):.1f} tok/s after the first)")
    print(f"serve: {how}: chunks {texts[:8]} ... {texts[-3:]}")

import openai
client = openai.OpenAI(base_url=base + "/v1", api_key="EMPTY", max_retries=0)
model = client.models.list().data[0].id
t0, arrivals, texts, tokens = time.monotonic(), [], [], 0
stream = client.completions.create(
    model=model, prompt=body["prompt"], max_tokens=128, temperature=0.0, stream=True,
    stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
for chunk in stream:
    if chunk.choices:
        arrivals.append(time.monotonic())
        texts.append(chunk.choices[0].text)
    if chunk.usage:
        tokens = chunk.usage.completion_tokens
report("openai client", t0, arrivals, texts, tokens)
assert tokens == 128, tokens

conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
t0, arrivals, texts, tokens, raw = time.monotonic(), [], [], 0, []
conn.request("POST", "/v1/completions", json.dumps({"model": model, **body}),
             {"Content-Type": "application/json"})
resp = conn.getresponse()
assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
for line in iter(resp.readline, b""):
    line = line.decode().rstrip("\n")
    if not line.startswith("data: "):
        continue
    raw.append(line)
    if line == "data: [DONE]":
        break
    event = json.loads(line[len("data: "):])
    if event["choices"]:
        arrivals.append(time.monotonic())
        texts.append(event["choices"][0]["text"])
    if event.get("usage"):
        tokens = event["usage"]["completion_tokens"]
print("serve: raw HTTP: first events", raw[:2], "last", raw[-2:])
report("raw HTTP", t0, arrivals, texts, tokens)
assert raw[-1] == "data: [DONE]" and tokens == 128, (raw[-1], tokens)
PY
    client_rc=${PIPESTATUS[0]}
    kill -TERM "$pid" 2>/dev/null
    local waited=0
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt 300 ]; do
        sleep 0.1
        waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "serve: the server still ran 30 s after SIGTERM; killed" | tee -a "$log"
        kill -KILL "$pid"
        wait "$pid"
        return 1
    fi
    wait "$pid"
    rc=$?
    echo "serve: exit status $rc, $((waited / 10)).$((waited % 10)) s after SIGTERM" | tee -a "$log"
    [ "$client_rc" = 0 ] && [ "$rc" = 0 ]
}

# lm-eval (issue 15): the seed's accuracy protocol, `lm_eval --model vllm` once per conv
# backend on the Codestral-7B shape with random weights, and the per-sample agreement
# (benchmarks/accuracy/lm_eval_compare.py; results in OUT/lm_eval/compare.md), after the GPU-marked
# lm-eval tests on the tiny model; ~4-6 minutes. The box lacks lm-eval and most of what it
# imports: its run-time wheels come packed as .whl/lmeval.tar.xz and the model directory
# (config.json + tokenizer, benchmarks/common/make_model_dir.py) as .whl/codestral, both carried
# (docs/lm_eval.md); pip installs the wheels into the box's Python, next to what it has.
lm_eval() {
    local log="$out/lm_eval.log" wheels=/tmp/lmeval_wheels model=${LM_EVAL_MODEL_DIR:-.whl/codestral} rc
    : >"$log"
    if [ ! -f .whl/lmeval.tar.xz ] || [ ! -f "$model/config.json" ]; then
        echo "lm_eval: carry .whl/lmeval.tar.xz and $model (docs/lm_eval.md)" | tee -a "$log"
        return 1
    fi
    python3 -c 'import importlib.metadata as m
for name in ("huggingface_hub", "fsspec", "pyarrow", "pandas", "requests", "transformers"):
    try:
        print(f"lm_eval: box has {name} {m.version(name)}")
    except m.PackageNotFoundError:
        print(f"lm_eval: box lacks {name}")' 2>&1 | tee -a "$log"
    { python3 -m benchmarks.accuracy.lm_eval_compare unpack-wheels .whl/lmeval.tar.xz "$wheels" &&
        python3 -m pip install --no-index --find-links "$wheels" --no-deps lm-eval==0.4.13 &&
        python3 -m pip install --no-index --find-links "$wheels" datasets pytablewriter \
            sacrebleu more-itertools dill requests tenacity; } >>"$log" 2>&1 ||
        { tail -n 30 "$log"; return 1; }
    python3 -m pytest tests/lm_eval -m gpu -q -p no:cacheprovider 2>&1 | tee -a "$log"
    rc=${PIPESTATUS[0]}
    python3 -m benchmarks.accuracy.lm_eval_compare run --model-dir "$model" --load-format dummy \
        --out "$out/lm_eval" >>"$log" 2>&1 || { tail -n 40 "$log"; return 1; }
    [ "$rc" = 0 ]
}

# Bamba-9B's shape (dummy bf16 weights) through benchmark_throughput.py, each conv backend
# (issue 13): HYBRID_BENCH_PROMPTS prompts (default 200) x 512 + 256 tokens, ~1-2 minutes each.
hybrid_bench() {
    local b rc=0
    for b in 1 0; do
        VLLM_USE_TRITON_CONV1D=$b python3 -m benchmarks.engine.benchmark_throughput --model bamba-9b \
            --dtype bfloat16 --num-prompts "${HYBRID_BENCH_PROMPTS:-200}" --input-len 512 \
            --output-len 256 --max-model-len 2048 --out "$out/bamba9b_conv$b.json" 2>&1 |
            tr '\r' '\n' | grep -v '^Generating' | tee "$out/bamba9b_conv$b.log" || rc=1
    done
    return $rc
}

# benchmark_serving against `vllm serve`, Triton conv against the CUDA split (issue 12):
# benchmarks/serving/serving_sweep.py on the Codestral-7B shape (dummy bf16 weights, Mistral's v3
# tokenizer: benchmarks/common/make_model_dir.py .whl/codestral) and a ShareGPT sample
# (benchmarks/serving/make_sharegpt_sample.py .whl/sharegpt_3000.json --num 3000 --tokenizer
# .whl/codestral), both carried. SERVING_SWEEP_ARGS replaces the runs (default: rate inf,
# 300 prompts, 3 repeats per backend, and the offline run twice; ~460 s); results in OUT/sweep.
serving_sweep() {
    local model=${SERVING_MODEL_DIR:-.whl/codestral} data=${SERVING_DATASET:-.whl/sharegpt_3000.json}
    serve_wheels "$out/serve_wheels.log" || return 1
    if [ ! -f "$model/config.json" ] || [ ! -f "$data" ]; then
        echo "serving_sweep: carry $model and $data (see the comment above this step)"
        return 1
    fi
    local runs="--conv-backends 1,0 --runs sharegpt@inf:300 --repeats 3 --offline sharegpt:300"
    runs="$runs --offline-repeats 2 --budget-s 460"
    local -a args
    eval "args=(${SERVING_SWEEP_ARGS:-$runs})"  # shell quoting: --server-args "..." works
    python3 -m benchmarks.serving.serving_sweep --model "$model" --dataset-path "$data" \
        --out "$out/sweep" "${args[@]}" 2>&1 | tee "$out/serving_sweep.log"
}

# Tensor parallelism on 2 GPUs (issue 16; the nvidia-h200-x2 kind): benchmarks/tp/benchmark_tp.py
# (Codestral-7B shape, dummy bf16 weights, TP=2 against TP=1 and an fp32 TP=1 yardstick:
# logits, throughput, step latency, the all-reduce cost per layer and per step; about 3
# minutes, at most its --budget-s of 330 s; TP_BENCH_ARGS adds options), then the multi-GPU
# tests of tests/distributed (NCCL, marked gpu; ~1-2 minutes). Fewer than 2 GPUs visible:
# skipped, saying so. NVLink multicast stays off for every rank (the device notes'
# KINDS.md); the tree goes first on PYTHONPATH, so the step also runs without `install`.
tp() {
    local log="$out/tp.log" gpus rc=0
    gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    if [ "${gpus:-0}" -lt 2 ]; then
        echo "tp: skipped: ${gpus:-0} GPU(s) visible; tensor parallelism needs 2 (kind nvidia-h200-x2)" |
            tee "$log"
        return 0
    fi
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.tp.benchmark_tp ${TP_BENCH_ARGS:-} --out "$out/tp.json" \
        --md "$out/tp.md" 2>&1 | tee "$log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    PYTHONPATH=$path python3 -m pytest tests/distributed -m gpu -q -p no:cacheprovider \
        --durations=10 --junitxml "$out/tp_tests.xml" 2>&1 | tee "$out/tp_tests.log"
    [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    return $rc
}

# GPU_CHECK_STEPS picks a subset (the device's calls are capped at 10 minutes each).
steps=${GPU_CHECK_STEPS:-environment install gpu_tests other_tests demo bench step_bench}
for s in $steps; do
    case $s in
    environment) step environment environment >"$out/env.txt" 2>&1 ;;
    vs_hf_arch) step "$s" "$s" ;; # issues 33/34's shapes, ours vs HF
    install | gpu_tests | other_tests | demo | bench | step_bench | e2e | e2e_cold_warm | \
        wheels | ssd_bench | replay_bench | selective_scan_bench | fused_moe_bench | \
        vs_hf | cold_start | serve | host_cost | hybrid_bench | lm_eval | \
        serving_sweep | tp) step "$s" "$s" ;;
    *) echo "unknown step: $s" >&2; failed+=("$s (unknown)") ;;
    esac
done

echo
echo "=== summary (logs in $out)"
if [ -f "$out/install.log" ]; then
    grep -E '^CUDA ops available|^install with the CUDA ops failed' "$out/install.log"
    if grep -q '^install with the CUDA ops failed' "$out/install.log"; then
        grep -E -i -B2 -A8 'error' "$out/install.log" | tail -n 40
    fi
fi
[ -f "$out/tests.log" ] && grep -E '^(FAILED|ERROR) |^=* ?[0-9]+ (passed|failed|error|skipped|deselected)|no tests ran' \
    "$out/tests.log"
[ -s "$out/test_records.txt" ] && sed 's/^/test record: /' "$out/test_records.txt"
[ -f "$out/demo.log" ] && sed -n '/^case /,$p' "$out/demo.log"
[ -f "$out/bench.log" ] && sed -n '/^# Causal-conv1d benchmark/,$p' "$out/bench.log"
[ -f "$out/host_cost.md" ] && cat "$out/host_cost.md"
for f in "$out"/bamba9b_conv*.log; do [ -f "$f" ] && grep -H '^Throughput' "$f"; done
[ -f "$out/wheels.log" ] && tail -n 1 "$out/wheels.log"
[ -f "$out/ssd/ssd_bench.md" ] && cat "$out/ssd/ssd_bench.md"
[ -f "$out/replay.log" ] && tail -n 40 "$out/replay.log"
[ -f "$out/selective_scan/selective_scan_bench.md" ] && cat "$out/selective_scan/selective_scan_bench.md"
[ -f "$out/fused_moe/fused_moe_bench.md" ] && cat "$out/fused_moe/fused_moe_bench.md"
[ -f "$out/replay_step.log" ] && grep -E -i 'decode|step' "$out/replay_step.log" | tail -n 24
[ -f "$out/vs_hf.md" ] && cat "$out/vs_hf.md"
for f in "$out"/vs_hf_*.md; do [ -f "$f" ] && cat "$f"; done
[ -f "$out/cold_start.log" ] && grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed|error|skipped)|no tests ran' \
    "$out/cold_start.log"
[ -f "$out/e2e_cold_warm.md" ] && cat "$out/e2e_cold_warm.md"
[ -f "$out/serve.log" ] && grep -E '^serve: (/health|openai client: first|raw HTTP: first chunk|exit status)' "$out/serve.log"
[ -f "$out/lm_eval.log" ] && grep -E '^lm_eval: |[0-9]+ (passed|failed|error|skipped)' "$out/lm_eval.log"
[ -f "$out/lm_eval/compare.md" ] && cat "$out/lm_eval/compare.md"
[ -f "$out/sweep/sweep.md" ] && cat "$out/sweep/sweep.md"
[ -f "$out/tp.log" ] && grep -E '^tp: skipped' "$out/tp.log"
[ -f "$out/tp.md" ] && cat "$out/tp.md"
[ -f "$out/tp_tests.log" ] && grep -E '^(FAILED|ERROR) |[0-9]+ (passed|failed|error|skipped)|no tests ran' \
    "$out/tp_tests.log"
if [ ${#failed[@]} -gt 0 ]; then
    printf 'failed step: %s\n' "${failed[@]}"
    exit 1
fi
echo "all steps passed"
