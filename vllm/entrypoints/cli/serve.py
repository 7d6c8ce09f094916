"""``vllm serve MODEL [options]``: the OpenAI-compatible server (api_server.py)."""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli.types import CLISubcommand


class ServeSubcommand(CLISubcommand):
    name = "serve"

    def subparser_init(self, subparsers) -> argparse.ArgumentParser:
        from vllm.entrypoints.openai.api_server import make_arg_parser

        parser = subparsers.add_parser(
            self.name,
            help="start the OpenAI-compatible HTTP server",
            description="Serve a Mamba2 model over the OpenAI API (/v1/completions, "
            "/v1/chat/completions, /v1/models, /tokenize, /metrics, ...).",
            usage="vllm serve MODEL [options]",
        )
        return make_arg_parser(parser, positional_model=True)

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        from vllm.entrypoints.openai.api_server import run

        run(args)


def cmd_init() -> list[CLISubcommand]:
    return [ServeSubcommand()]
