"""The `ringserve` command line."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ringserve",
        description="A paged inference server for sliding-window-attention models.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    gen = sub.add_parser("generate", help="one completion from the terminal")
    gen.add_argument("prompt")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # NOTE: the engine and HTTP server land in later issues; until then say so plainly
    # instead of pretending to serve.
    print(
        f"ringserve {args.command}: not available yet; the block manager is built, the "
        "kernels, models, engine and server are still to come (see README.md).",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
