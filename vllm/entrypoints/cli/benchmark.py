"""``vllm bench serve [options]``: the serving benchmark (vllm/benchmarks/serve.py) as a
vllm subcommand; ``python -m vllm.benchmarks.serve`` runs the same code."""

from __future__ import annotations

import argparse
import sys

from vllm.benchmarks import serve
from vllm.entrypoints.cli.types import CLISubcommand


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
        serve_parser = benchmarks.add_parser(
            "serve",
            help="online serving: TTFT, TPOT, ITL and throughput of an OpenAI-compatible server",
            description=(serve.__doc__ or "").split("\n")[0],
            usage="vllm bench serve [options]",
        )
        serve.add_cli_args(serve_parser)
        return parser

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        serve.main(args, ["vllm", *sys.argv[1:]])


def cmd_init() -> list[CLISubcommand]:
    return [BenchSubcommand()]
