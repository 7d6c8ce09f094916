# Sourced by scripts/gpu_check.sh (the one entry point): its server, lm-eval and
# old-against-new steps. Each runs in the repository root with $out (the results folder) set.
# shellcheck shell=bash disable=SC2154

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

# An old commit against this tree, end to end in one call (issue 28's check): OLD_TREE
# (default .whl/old, carried: `git archive COMMIT | tar -x -C .whl/old`) and this tree, each
# on its own PYTHONPATH and with its own benchmark scripts (the old layout's
# benchmarks/*.py or this one's packages). Offline: benchmark_throughput on the Codestral-7B
# shape (dummy bf16 weights, fp32 SSM state, 128 prompts x 512 + 256 tokens, cold start,
# --prefill-run), OLD_NEW_REPEATS (default 2) fresh processes per tree in ABBA order. Then
# serving: per tree one `vllm serve` (serving_sweep, the Triton conv) running ShareGPT at
# rate inf, 300 prompts, twice; carry .whl/codestral and .whl/sharegpt_3000.json as for
# serving_sweep. OLD_NEW_THROUGHPUT_ARGS / OLD_NEW_SERVING_ARGS replace the two argument
# lists (a CPU smoke run: a tiny shape). Table: OUT/old_new/old_new.md
# (benchmarks/engine/old_new_report.py); ~7-8 minutes.
old_new() {
    local old=${OLD_TREE:-.whl/old} model=${SERVING_MODEL_DIR:-.whl/codestral}
    local data=${SERVING_DATASET:-.whl/sharegpt_3000.json} dir="$out/old_new" rc=0 i t
    serve_wheels "$out/serve_wheels.log" || return 1
    if [ ! -d "$old/vllm" ] || [ ! -f "$model/config.json" ] || [ ! -f "$data" ]; then
        echo "old_new: carry $old (an old tree), $model and $data (see above)"
        return 1
    fi
    old=$(cd "$old" && pwd) model=$(cd "$model" && pwd) data=$(cd "$(dirname "$data")" && pwd)/$(basename "$data")
    mkdir -p "$dir"
    local -a thr=(--model codestral-7b --dtype bfloat16 --mamba-ssm-cache-dtype float32
        --num-prompts 128 --input-len 512 --output-len 256 --max-num-seqs 128 --prefill-run)
    local -a serving=(--conv-backends 1 --runs sharegpt@inf:300 --repeats 2)
    [ -n "${OLD_NEW_THROUGHPUT_ARGS:-}" ] && eval "thr=($OLD_NEW_THROUGHPUT_ARGS)"
    [ -n "${OLD_NEW_SERVING_ARGS:-}" ] && eval "serving=($OLD_NEW_SERVING_ARGS)"
    run_tree() { # run_tree old|new throughput|sweep ARGS...: that tree's own script
        local tree=$1 kind=$2 root=$PWD
        shift 2
        local -a cmd=(-m benchmarks.engine.benchmark_throughput)
        [ "$kind" = sweep ] && cmd=(-m benchmarks.serving.serving_sweep)
        if [ "$tree" = old ]; then # the old layout: scripts by path, before the packages
            root=$old cmd=(benchmarks/benchmark_throughput.py)
            [ "$kind" = sweep ] && cmd=(benchmarks/serving_sweep.py)
        fi
        (cd "$root" && VLLM_USE_TRITON_CONV1D=1 PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" \
            python3 "${cmd[@]}" "$@")
    }
    for ((i = 0; i < ${OLD_NEW_REPEATS:-2}; i++)); do
        for t in $( ((i % 2)) && echo new old || echo old new); do
            echo "old_new: $t throughput r$i"
            run_tree "$t" throughput "${thr[@]}" --out "$dir/$t-throughput-r$i.json" \
                >"$dir/$t-throughput-r$i.log" 2>&1 || { rc=1; tail -20 "$dir/$t-throughput-r$i.log"; }
        done
    done
    for t in old new; do
        echo "old_new: $t serving"
        run_tree "$t" sweep --model "$model" --dataset-path "$data" --out "$dir/$t-sweep" \
            "${serving[@]}" >"$dir/$t-sweep.log" 2>&1 || { rc=1; tail -20 "$dir/$t-sweep.log"; }
    done
    python3 -m benchmarks.engine.old_new_report "$dir" --md "$dir/old_new.md" || rc=1
    return $rc
}

# Prefix caching on against off, served (issue 31): benchmarks/serving/benchmark_prefix_caching.py
# with one `vllm serve` per mode running every workload. PREFIX_BENCH_SHAPE: "codestral"
# (default: the carried .whl/codestral) or a benchmarks/common/model_shapes.py name such as
# bamba-9b (its directory made here with .whl/codestral's tokenizer, shape_model_dir.py).
# Carry .whl/serve, .whl/codestral and .whl/sharegpt_multiturn.json (whole conversations:
# `python -m benchmarks.serving.make_sharegpt_sample .whl/sharegpt_multiturn.json
# --multiturn --num 400 --tokenizer .whl/codestral`). PREFIX_BENCH_ARGS replaces
# the workload arguments, PREFIX_BENCH_SERVER_ARGS the server's. Table:
# OUT/prefix/prefix_caching.md; ~5-6 minutes per shape with the defaults.
prefix_bench() {
    local shape=${PREFIX_BENCH_SHAPE:-codestral} model=.whl/codestral
    local data=${PREFIX_BENCH_DATASET:-.whl/sharegpt_multiturn.json}
    serve_wheels "$out/serve_wheels.log" || return 1
    if [ ! -f "$model/config.json" ] || [ ! -f "$data" ]; then
        echo "prefix_bench: carry $model and $data (see the comment above this step)"
        return 1
    fi
    if [ "$shape" != codestral ]; then
        python3 -m benchmarks.common.shape_model_dir "/tmp/shape-$shape" --shape "$shape" \
            --tokenizer-from "$model" || return 1
        model=/tmp/shape-$shape
    fi
    local runs="--workloads multiturn_ids@2,multiturn_ids,multiturn,prefix_repetition@4,random"
    runs="$runs --num-prompts 64 --max-concurrency 32 --prefix-len 2000 --suffix-len 128"
    runs="$runs --num-prefixes 1 --input-len 1024 --output-len 128"
    local server="--load-format dummy --dtype bfloat16 --mamba-block-size 64 --max-model-len 4096"
    local -a args
    eval "args=(${PREFIX_BENCH_ARGS:-$runs})"
    python3 -m benchmarks.serving.benchmark_prefix_caching --model "$model" \
        --dataset-path "$data" --out "$out/prefix" "${args[@]}" \
        --server-args "${PREFIX_BENCH_SERVER_ARGS:-$server}" 2>&1 | tee "$out/prefix_bench.log"
}

# CUDA graph modes served (issue 32): serving_sweep.py once per cudagraph_mode of
# GRAPH_MODES (default "FULL_DECODE_ONLY FULL": graphs for decode-only steps only, or for
# mixed prefill + decode steps too), each its own `vllm serve` (Triton conv, its own empty
# Triton cache) given the mode as vLLM's --compilation-config JSON, running
# GRAPH_MODES_RUNS (default sharegpt@8:300,sharegpt@inf:300) GRAPH_MODES_REPEATS times
# (default 1; repeats against the same server). GRAPH_MODES_SERVER_ARGS is appended to the
# server's options (e.g. --max-num-seqs 128: the last one given wins). A mode may name a
# variant, MODE+NAME (e.g. FULL+lpt512): that server also gets GRAPH_MODES_VARIANT_NAME's
# options (e.g. GRAPH_MODES_VARIANT_lpt512="--long-prefill-token-threshold 512"), so one
# call compares a server option under the same mode. Carry .whl/serve,
# .whl/codestral and .whl/sharegpt_3000.json as for serving_sweep. Table (per workload@rate:
# tok/s, TTFT, ITL, graph / eager steps, start-up; FULL against FULL_DECODE_ONLY):
# OUT/graph_modes/graph_modes.md (benchmarks/serving/graph_modes_report.py). Per mode: the
# server's start from an empty Triton cache ~30-60 s, rate 8 ~45 s, rate inf ~40 s: ~2-2.5
# minutes, ~4-5 for both modes (add ~1.5 minutes per mode for each further repeat).
graph_modes_server_args() { # graph_modes_server_args MODE[+NAME]: serving_sweep's --server-args
    # serving_sweep splits them with shlex: the JSON goes in single quotes.
    local mode=${1%%+*} variant="" extra
    [[ $1 == *+* ]] && variant=${1#*+}
    local args="--load-format dummy --dtype bfloat16 --max-num-seqs 256"
    args="$args --max-num-batched-tokens 4096"
    args="$args --compilation-config '{\"cudagraph_mode\": \"$mode\"}'"
    args="$args${GRAPH_MODES_SERVER_ARGS:+ $GRAPH_MODES_SERVER_ARGS}"
    if [ -n "$variant" ]; then
        extra="GRAPH_MODES_VARIANT_$variant"
        args="$args${!extra:+ ${!extra}}"
    fi
    echo "$args"
}
graph_modes() {
    local model=${SERVING_MODEL_DIR:-.whl/codestral} data=${SERVING_DATASET:-.whl/sharegpt_3000.json}
    local dir="$out/graph_modes" rc=0 mode
    local -a modes
    read -r -a modes <<<"${GRAPH_MODES:-FULL_DECODE_ONLY FULL}"
    serve_wheels "$out/serve_wheels.log" || return 1
    if [ ! -f "$model/config.json" ] || [ ! -f "$data" ]; then
        echo "graph_modes: carry $model and $data (see the comment above this step)"
        return 1
    fi
    mkdir -p "$dir"
    for mode in "${modes[@]}"; do
        if [[ ! $mode =~ ^[A-Za-z_]+(\+[A-Za-z0-9_]+)?$ ]]; then
            echo "graph_modes: $mode is no cudagraph_mode name (MODE or MODE+NAME)"
            rc=1
            continue
        fi
        if [[ $mode == *+* ]]; then
            local extra="GRAPH_MODES_VARIANT_${mode#*+}"
            if [ -z "${!extra:-}" ]; then
                echo "graph_modes: $mode names a variant but $extra is not set"
                rc=1
                continue
            fi
        fi
        echo "graph_modes: $mode: $(graph_modes_server_args "$mode")"
        python3 -m benchmarks.serving.serving_sweep --model "$model" --dataset-path "$data" \
            --conv-backends 1 --out "$dir/$mode" \
            --runs "${GRAPH_MODES_RUNS:-sharegpt@8:300,sharegpt@inf:300}" \
            --repeats "${GRAPH_MODES_REPEATS:-1}" --server-args "$(graph_modes_server_args "$mode")" \
            2>&1 | tee "$dir/$mode.log"
        [ "${PIPESTATUS[0]}" = 0 ] || rc=1
    done
    python3 -m benchmarks.serving.graph_modes_report "$dir" --modes "${modes[@]}" || rc=1
    return $rc
}
