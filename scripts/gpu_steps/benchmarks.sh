# Sourced by scripts/gpu_check.sh (the one entry point): its benchmark steps. Each runs in
# the repository root with $out (the results folder) set and step() recording failures.
# shellcheck shell=bash disable=SC2154

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
# a carried .upstream/ holds them (~1 minute), then the CUDA-graph decode step at each batch
# of REPLAY_STEP_BATCHES (default 128; "1 8 128" is the rule of a device's entry in
# engine_default.json), fp32 and bf16 state, replay on and off (~2 minutes a batch).
# REPLAY_BENCH_ARGS adds kernel options.
replay_bench() {
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}"
    [ -d .upstream ] && path="$path:$PWD/.upstream"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.benchmark_replayssm ${REPLAY_BENCH_ARGS:-} \
        --out "$out/replay" 2>&1 | tee "$out/replay.log"
    local dtype flag b name
    for b in ${REPLAY_STEP_BATCHES:-128}; do
        for dtype in float32 bfloat16; do
            for flag in --use-replayssm --no-use-replayssm; do
                name="step_${dtype}${flag}"
                [ "$b" = 128 ] || name="step_b${b}_${dtype}${flag}"
                python3 -m benchmarks.engine.benchmark_mamba2_step --backends triton \
                    --decode-batch "$b" --num-decodes $((b > 1 ? b - 1 : 1)) --iters 16 \
                    --mamba-ssm-cache-dtype $dtype $flag --out "$out/replay/$name.json" 2>&1 |
                    tee -a "$out/replay_step.log"
            done
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
# The SSD's launch table swept on this device (benchmarks/kernels/tune_ssd.py, docs/ssd.md):
# SSD_TUNE_ARGS (default: the three record cases, every kernel's variants; e.g. "--kernels
# chunk_state" for the FUSED_PASS variants only) then --write, so configs/ssd/<device>.json
# in the tree is rewritten when the sweep's best beats the current entry (kept, with every
# timing, as OUT/ssd_tune/; commit it). Upstream's per-kernel split with .upstream carried
# and --upstream-split. ~2-4 minutes for the chunk state's variants.
ssd_tune() {
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}" dir="$out/ssd_tune" table
    [ -d .upstream ] && path="$path:$PWD/.upstream"
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.tune_ssd \
        ${SSD_TUNE_ARGS:---cases 1x8192 16x512_init 1x2048} --write \
        --json "$dir/tune_ssd.json" 2>&1 | tee "$dir/tune.log"
    [ "${PIPESTATUS[0]}" = 0 ] || return 1
    for table in vllm/model_executor/layers/mamba/ops/configs/ssd/NVIDIA_*.json; do
        [ -f "$table" ] && cp "$table" "$dir/"
    done
    return 0
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
# The selective scan's launch table tuned on this device (benchmarks/kernels/
# tune_selective_scan.py, docs/selective_scan.md): writes configs/selective_scan/<device>.json
# in the tree (kept as OUT/selective_scan_tune/ with every candidate's times), then runs
# selective_scan_bench's benchmark again with it into OUT/selective_scan_tuned; ~4 minutes
# at most of tuning plus the benchmark's ~1-2. Run selective_scan_bench before it in the same
# call to have the default table's figures.
selective_scan_tune() {
    local dir="$out/selective_scan_tune" table
    mkdir -p "$dir"
    python3 -m benchmarks.kernels.tune_selective_scan --write --json "$dir/tune.json" 2>&1 |
        tee "$dir/tune.log"
    [ "${PIPESTATUS[0]}" = 0 ] || return 1
    for table in vllm/model_executor/layers/mamba/ops/configs/selective_scan/NVIDIA_*.json; do
        [ -f "$table" ] && cp "$table" "$dir/"
    done
    # shellcheck disable=SC2086
    python3 -m benchmarks.kernels.benchmark_selective_scan ${SCAN_BENCH_ARGS:-} \
        --out "$out/selective_scan_tuned" 2>&1 | tee "$out/selective_scan_tuned.log"
}
# The fused-MoE launch table tuned on this device (benchmarks/kernels/tune_fused_moe.py,
# docs/fused_moe.md): writes configs/fused_moe/<device>.json in the tree (kept as
# OUT/fused_moe_tune/ with every timing), then runs fused_moe_bench's benchmark again with
# it into OUT/fused_moe_tuned; ~2 minutes of tuning for the two benchmark shapes, plus the
# benchmark's ~2. MOE_TUNE_ARGS adds options (e.g. --shapes ...,granite-4.0-h-tiny).
# Run fused_moe_bench before it in the same call to have the default table's figures.
fused_moe_tune() {
    local path="$PWD${PYTHONPATH:+:$PYTHONPATH}" dir="$out/fused_moe_tune" table
    [ -d .upstream ] && path="$path:$PWD/.upstream"
    mkdir -p "$dir"
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.tune_fused_moe ${MOE_TUNE_ARGS:-} \
        --json "$dir/tune_fused_moe.json" 2>&1 | tee "$dir/tune.log"
    [ "${PIPESTATUS[0]}" = 0 ] || return 1
    for table in vllm/model_executor/layers/fused_moe/configs/fused_moe/NVIDIA_*.json; do
        [ -f "$table" ] && cp "$table" "$dir/"
    done
    # shellcheck disable=SC2086
    PYTHONPATH=$path python3 -m benchmarks.kernels.benchmark_fused_moe ${MOE_BENCH_ARGS:-} \
        --out "$out/fused_moe_tuned" 2>&1 | tee "$out/fused_moe_tuned.log"
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
