"""The index and search commands through a parser built from their own subparsers (the CLI tests
of the float, one-byte and compressed corpora share it)."""

import argparse

from maxsim.search.cli import add_index_parser, add_search_parser


def parse(argv):
    parser = argparse.ArgumentParser(prog="maxsim")
    sub = parser.add_subparsers(dest="command", required=True)
    add_index_parser(sub)
    add_search_parser(sub)
    return parser.parse_args(argv)


def run(argv):
    """Runs ``python -m maxsim <argv>``'s index / search command; returns its exit code."""
    args = parse(argv)
    return args.run(args)
