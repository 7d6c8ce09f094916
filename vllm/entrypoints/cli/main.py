"""The ``vllm`` console script: ``vllm <subcommand> [options]``, as upstream's CLI.

Each subcommand module offers ``cmd_init() -> list[CLISubcommand]``; a new one (``vllm bench
serve``, say: a subcommand whose own subparsers hold ``serve``) is one more module in
``_MODULES``.
"""

from __future__ import annotations

import argparse
import importlib

import vllm
from vllm.entrypoints.cli.startup import run_or_exit

_MODULES = ("vllm.entrypoints.cli.serve", "vllm.entrypoints.cli.benchmark")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vllm", description="vLLM's command line for Mamba2 models (this project)"
    )
    parser.add_argument("-v", "--version", action="version", version=vllm.__version__)
    subparsers = parser.add_subparsers(dest="subcommand", metavar="<command>", required=True)
    commands = {}
    for module in _MODULES:
        for command in importlib.import_module(module).cmd_init():
            command.subparser_init(subparsers).set_defaults(dispatch=command.cmd)
            commands[command.name] = command
    args = parser.parse_args(argv)
    commands[args.subcommand].validate(args)
    run_or_exit(f"vllm {args.subcommand}", args.dispatch, args)


if __name__ == "__main__":
    main()
