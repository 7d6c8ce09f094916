"""``vllm bench serve [options]``: benchmarks/benchmark_serving.py as a vllm subcommand.

The benchmark lives in the source tree's benchmarks/ folder (beside the vllm package, as in
an editable install, which is how this project is installed): it is loaded from there by
path, so the subcommand and ``python benchmarks/benchmark_serving.py`` run the same code.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

from vllm.entrypoints.cli.types import CLISubcommand

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "benchmark_serving.py"


def load_benchmark():
    if not SCRIPT.is_file():
        raise SystemExit(
            f"vllm bench serve needs the source tree's {SCRIPT} (install vllm with "
            "`pip install -e .` from a checkout)"
        )
    module = sys.modules.get("benchmark_serving")
    if module is None:
        spec = importlib.util.spec_from_file_location("benchmark_serving", SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules["benchmark_serving"] = module
        spec.loader.exec_module(module)
    return module


class BenchSubcommand(CLISubcommand):
    name = "bench"

    def subparser_init(self, subparsers) -> argparse.ArgumentParser:
        parser = subparsers.add_parser(
            self.name,
            help="benchmark a running server",
            description="Benchmarks (vLLM's `vllm bench`).",
            usage="vllm bench <benchmark> [options]",
        )
        benchmarks = parser.add_subparsers(dest="bench_type", metavar="<benchmark>")
        benchmarks.required = True
        serve = benchmarks.add_parser(
            "serve",
            help="online serving: TTFT, TPOT, ITL and throughput of an OpenAI-compatible server",
            description=(load_benchmark().__doc__ or "").split("\n")[0],
            usage="vllm bench serve [options]",
        )
        load_benchmark().add_cli_args(serve)
        return parser

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        load_benchmark().main(args, ["vllm", *sys.argv[1:]])


def cmd_init() -> list[CLISubcommand]:
    return [BenchSubcommand()]
