"""Start `vllm serve`, stream one completion from it over HTTP, print it, stop the server.

    python -m examples.serve_demo [--max-tokens N] [--prompt TEXT] [--model DIR]   # repo root

Without ``--model``: on the CPU a tiny Mamba2 directory made on the spot (random weights, a
real byte-level BPE tokenizer with a chat template: ``tests/tiny_model.py``); on a GPU the
Mamba-Codestral-7B shape with random bf16 weights (``--load-format dummy`` reads only its
config.json) and the engine's byte-level tokenizer (the directory has no tokenizer files).
Random weights know no language: the text is noise. The demo shows the server's path (HTTP
in, Server-Sent Events out, one chunk per token as soon as it exists) and its timings. Only
the standard library talks to the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def model_dir(args, on_cuda: bool, workdir: Path) -> tuple[Path, list[str]]:
    """The directory to serve and the engine options it needs."""
    if args.model:
        return Path(args.model), []
    if not on_cuda:
        from tests.tiny_model import make_tiny_model_dir

        tiny = make_tiny_model_dir(workdir / "tiny")
        return tiny, ["--max-num-seqs", "4", "--max-model-len", "512"]
    from vllm.model_executor.models.mamba2_config import Mamba2ModelConfig

    big = workdir / "codestral-7b-shape"
    big.mkdir()
    config = {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2"}
    fields = dataclasses.asdict(Mamba2ModelConfig()).items()
    config.update({k: v for k, v in fields if v is not None})
    (big / "config.json").write_text(json.dumps(config, indent=2))
    return big, ["--load-format", "dummy", "--dtype", "bfloat16", "--max-num-seqs", "16"]


def wait_healthy(port: int, proc: subprocess.Popen, timeout_s: float) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during start-up (status {proc.returncode})")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return time.monotonic() - start
        except OSError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s")


def stream_completion(port: int, model: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise SystemExit(f"HTTP {resp.status}: {resp.read().decode()}")
    arrivals, text, usage = [], "", None
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: ") :])
        if chunk.get("usage"):
            usage = chunk["usage"]
        for choice in chunk.get("choices", []):
            arrivals.append(time.monotonic())
            text += choice["text"]
            print(choice["text"], end="", flush=True)
    print()
    done = time.monotonic()
    return {
        "text": text,
        "chunks": len(arrivals),
        "first_chunk_ms": 1e3 * (arrivals[0] - t0),
        "tokens_per_s": usage["completion_tokens"] / (done - arrivals[0]) if usage else None,
        "usage": usage,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="an HF Mamba2 directory (default: made here)")
    p.add_argument("--prompt", default="Mamba2 is a state space model that")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--port", type=int, default=8311)
    args = p.parse_args(argv)
    import torch

    on_cuda = torch.cuda.is_available()
    env = dict(os.environ)
    if not on_cuda:
        env.setdefault("TRITON_INTERPRET", "1")
    workdir = Path(tempfile.mkdtemp(prefix="serve_demo_"))
    try:
        path, opts = model_dir(args, on_cuda, workdir)
        cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(path)]
        cmd += ["--host", "127.0.0.1", "--port", str(args.port), *opts]
        print("$ vllm serve", " ".join(cmd[4:]), flush=True)
        with open(workdir / "server.log", "w") as log:
            proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            try:
                ready_s = wait_healthy(args.port, proc, timeout_s=900)
                print(f"server ready in {ready_s:.1f} s; streaming {args.max_tokens} tokens:")
                res = stream_completion(args.port, str(path), args.prompt, args.max_tokens)
            except BaseException:
                print((workdir / "server.log").read_text()[-4000:], file=sys.stderr)
                raise
            finally:
                proc.send_signal(signal.SIGTERM)
                rc = proc.wait(timeout=60)
        res.update(server_ready_s=ready_s, server_exit_status=rc)
        speed = f"{res['tokens_per_s']:.1f}" if res["tokens_per_s"] else "?"
        print(
            f"{res['chunks']} chunks, first after {res['first_chunk_ms']:.0f} ms, "
            f"{speed} tokens/s after it; server stopped (SIGTERM), exit status {rc}"
        )
        return res
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
