"""What a ``vllm`` subcommand provides (as upstream's CLISubcommand): its name, its
argparse subparser, and what it runs."""

from __future__ import annotations

import argparse


class CLISubcommand:
    name: str

    def subparser_init(self, subparsers) -> argparse.ArgumentParser:
        """Add this subcommand's parser to ``subparsers`` and return it."""
        raise NotImplementedError

    def validate(self, args: argparse.Namespace) -> None:
        """Refuse argument combinations argparse cannot express (parser.error)."""

    @staticmethod
    def cmd(args: argparse.Namespace) -> None:
        raise NotImplementedError
