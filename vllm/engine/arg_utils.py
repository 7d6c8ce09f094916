"""EngineArgs: the one set of engine options that ``LLM``, ``vllm serve`` and lm-eval share.

``EngineArgs(model=..., **options).create_engine_config()`` gives the checked
``EngineConfig``; ``EngineArgs.add_cli_args(parser)`` adds the same options to an argparse
parser as vLLM names them (``--max-num-seqs``, ``--dtype``, ...), and
``EngineArgs.from_cli_args(namespace)`` reads them back. ``--compilation-config`` (``-cc``)
takes vLLM's JSON: ``-cc '{"cudagraph_mode": "FULL"}'`` (``vllm.config.CompilationConfig``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields
from typing import Any

from vllm.config import CUDAGRAPH_MODES, CompilationConfig, EngineConfig


def _compilation_config(text: str) -> CompilationConfig:
    """``--compilation-config``'s JSON, checked (argparse names the flag in its error)."""
    try:
        return CompilationConfig.from_any(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


_DTYPE_CHOICES = ("auto", "float32", "float16", "bfloat16", "half", "float", "fp32", "fp16", "bf16")


@dataclass
class EngineArgs:
    model: str | os.PathLike | Any  # a directory, a Hub id, or a registered model config
    tokenizer: str | os.PathLike | None = None
    revision: str | None = None
    tokenizer_revision: str | None = None
    download_dir: str | None = None
    served_model_name: str | None = None
    load_format: str = "auto"
    dtype: str | None = None
    device: str = "auto"
    seed: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    long_prefill_token_threshold: int = 0
    max_mixed_step_ratio: float = 0.0
    max_model_len: int | None = None
    enforce_eager: bool = False
    mamba_ssm_cache_dtype: str = "float32"
    async_scheduling: bool = True
    late_dispatch: bool | None = None
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    tensor_parallel_size: int = 1
    use_replayssm: bool | None = None
    replayssm_buffer_len: int = 16
    enable_prefix_caching: bool | None = None
    mamba_block_size: int = 64
    num_checkpoint_lines: int | None = None
    mamba_cache_mode: str = "align"
    enable_mamba_shared_prefix_checkpoint: bool = True
    enable_mamba_prompt_end_checkpoint: bool = False
    enable_mamba_align_cold_checkpoint: bool = False
    # None, a dict, its JSON or a CompilationConfig: {"cudagraph_mode": ...}.
    compilation_config: Any = None

    def create_engine_config(self) -> EngineConfig:
        kwargs = {f.name: getattr(self, f.name) for f in fields(self)}
        return EngineConfig(**kwargs)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        # One copy of each default: the dataclass's.
        d = {f.name: f.default for f in fields(EngineArgs)}
        g = parser.add_argument_group("engine")
        g.add_argument(
            "--tokenizer",
            default=None,
            help="tokenizer directory or Hugging Face Hub id (default: the model's)",
        )
        g.add_argument(
            "--revision",
            default=None,
            help="branch, tag or commit of a Hub model id (default: main)",
        )
        g.add_argument(
            "--tokenizer-revision",
            default=None,
            help="branch, tag or commit of a Hub tokenizer id (default: the model's revision)",
        )
        g.add_argument(
            "--download-dir",
            default=None,
            help="Hugging Face cache folder for Hub ids (default: huggingface_hub's, "
            "HF_HUB_CACHE or ~/.cache/huggingface/hub)",
        )
        g.add_argument(
            "--served-model-name",
            default=None,
            help="the model name the API answers to (default: the model argument)",
        )
        g.add_argument(
            "--load-format",
            choices=("auto", "safetensors", "dummy"),
            default=d["load_format"],
            help="dummy: random weights of the model's config.json",
        )
        g.add_argument("--dtype", choices=_DTYPE_CHOICES, default="auto")
        g.add_argument("--device", default=d["device"], help="cuda, cpu or auto")
        g.add_argument("--seed", type=int, default=d["seed"])
        g.add_argument(
            "--max-num-seqs",
            type=int,
            default=d["max_num_seqs"],
            help="sequences per step (= slots)",
        )
        g.add_argument(
            "--max-num-batched-tokens",
            type=int,
            default=d["max_num_batched_tokens"],
            help="token budget of one step",
        )
        g.add_argument(
            "--long-prefill-token-threshold",
            type=int,
            default=d["long_prefill_token_threshold"],
            help="most tokens one prompt prefills in a step; a longer prompt goes on in "
            "chunks over later steps (0: off, only the step budget cuts)",
        )
        g.add_argument(
            "--max-mixed-step-ratio",
            type=float,
            default=d["max_mixed_step_ratio"],
            help="cut each prompt's chunk beside running decodes so that the step takes about "
            "this many times a decode-only step, from the measured step times (>= 1; 0: off)",
        )
        g.add_argument(
            "--max-model-len",
            type=int,
            default=None,
            help="longest prompt + output in tokens (default: from the config, else 2048)",
        )
        g.add_argument(
            "--enforce-eager",
            action="store_true",
            help="no CUDA graphs: cudagraph_mode NONE, whatever --compilation-config says",
        )
        g.add_argument(
            "--compilation-config",
            "-cc",
            type=_compilation_config,
            default=None,
            help="vLLM's compilation config as JSON; read: cudagraph_mode, one of "
            f"{', '.join(CUDAGRAPH_MODES)} (default FULL: decode-only and mixed prefill + "
            "decode steps replay CUDA graphs; FULL_DECODE_ONLY: decode-only steps only), and "
            "max_cudagraph_capture_size (the most tokens of a graphed step, default 2048), "
            'e.g. \'{"cudagraph_mode": "FULL"}\'',
        )
        g.add_argument(
            "--mamba-ssm-cache-dtype",
            choices=("float32", "bfloat16", "float16"),
            default=d["mamba_ssm_cache_dtype"],
            help="dtype of the SSM state pool",
        )
        g.add_argument(
            "--block-size",
            type=int,
            default=d["block_size"],
            help="tokens per KV-cache block (models with attention layers)",
        )
        g.add_argument(
            "--gpu-memory-utilization",
            type=float,
            default=d["gpu_memory_utilization"],
            help="fraction of GPU memory the engine may use; sizes the KV cache (unused "
            "for models without attention layers, such as pure Mamba2)",
        )
        g.add_argument(
            "--num-gpu-blocks-override",
            type=int,
            default=None,
            help="KV-cache blocks to allocate, instead of sizing them from memory",
        )
        g.add_argument(
            "--tensor-parallel-size",
            "-tp",
            type=int,
            default=d["tensor_parallel_size"],
            help="processes (GPUs) the model is sharded over, by heads (Mamba2 models)",
        )
        g.add_argument(
            "--use-replayssm",
            action=argparse.BooleanOptionalAction,
            default=d["use_replayssm"],
            help="replayed decode for the Mamba2 layers: a state slot is written every "
            "--replayssm-buffer-len steps, its last steps' inputs kept in a ring "
            "(default: VLLM_USE_REPLAYSSM if set, else the GPU's measured default, on for "
            "the H100, off elsewhere as upstream; --no-use-replayssm: every step)",
        )
        g.add_argument(
            "--replayssm-buffer-len",
            type=int,
            default=d["replayssm_buffer_len"],
            help="decode steps between two writes of a state slot under --use-replayssm (2..128)",
        )
        g.add_argument(
            "--enable-prefix-caching",
            action=argparse.BooleanOptionalAction,
            default=d["enable_prefix_caching"],
            help="restore cached Mamba state checkpoints of shared prefixes (default: on "
            "where a checkpoint line fits in memory)",
        )
        g.add_argument(
            "--mamba-block-size",
            type=int,
            default=d["mamba_block_size"],
            help="tokens per hashed block of the Mamba state prefix cache",
        )
        g.add_argument(
            "--num-checkpoint-lines",
            type=int,
            default=d["num_checkpoint_lines"],
            help="state-pool lines for prefix-cache checkpoints (default: max_num_seqs, "
            "fewer on a GPU where they would take over half the memory left)",
        )
        g.add_argument(
            "--mamba-cache-mode",
            default=d["mamba_cache_mode"],
            help="prompt checkpoints under --enable-prefix-caching: align (default: the end "
            "of a prefill chunk the budget cuts, rounded down to the block grid), all (every "
            "block boundary, one step per block) or none (no Mamba state cached)",
        )
        g.add_argument(
            "--enable-mamba-shared-prefix-checkpoint",
            action=argparse.BooleanOptionalAction,
            default=d["enable_mamba_shared_prefix_checkpoint"],
            help="under --mamba-cache-mode align, checkpoint the deepest block boundary an "
            "earlier prompt shared (a common system prompt; default on)",
        )
        g.add_argument(
            "--enable-mamba-prompt-end-checkpoint",
            action=argparse.BooleanOptionalAction,
            default=d["enable_mamba_prompt_end_checkpoint"],
            help="also checkpoint the state after each whole prompt, so that a chat turn whose "
            "history does not hold the ids generated (a template that drops reasoning) "
            "restores the previous prompt (default off: a second line per request)",
        )
        g.add_argument(
            "--enable-mamba-align-cold-checkpoint",
            action=argparse.BooleanOptionalAction,
            default=d["enable_mamba_align_cold_checkpoint"],
            help="under --mamba-cache-mode align, also checkpoint the budget-cut chunk ends of "
            "a prompt whose first block no earlier prompt had (default off: each checkpoint "
            "copies a whole state line, which a unique prompt rarely repays)",
        )
        g.add_argument(
            "--no-async-scheduling",
            dest="async_scheduling",
            action="store_false",
            help="read each step's tokens before dispatching the next",
        )
        g.add_argument(
            "--late-dispatch",
            action=argparse.BooleanOptionalAction,
            default=d["late_dispatch"],
            help="under async scheduling, wait for new requests until just before the device "
            "ends its decode step, so that one arriving meanwhile joins the next step (one "
            "step less of time to first token; default: on with async scheduling)",
        )
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = [f.name for f in fields(cls)]
        values = {n: getattr(args, n) for n in names if hasattr(args, n)}
        if values.get("dtype") == "auto":
            values["dtype"] = None
        return cls(**values)
