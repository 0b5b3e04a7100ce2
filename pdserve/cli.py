"""``pdserve`` command line: ``pdserve serve [--model PATH] [--port P] ...`` (every config field is a flag)."""
from __future__ import annotations

import argparse
import logging
import sys

from pdserve.config import add_arguments, load_config
from pdserve.errors import ConfigError, PdserveError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="LLM serving with disaggregated prefill/decode")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the engine and its OpenAI-compatible HTTP server",
                           description="Every flag can also be set by the env var PDSERVE_<FIELD>.")
    add_arguments(serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        loaded = load_config(vars(args))
    except ConfigError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=loaded.config.log_level.upper(),
                        format="%(asctime)s supervisor %(levelname)s %(message)s")
    if args.command == "serve":
        from actors.supervisor import serve

        try:
            return serve(loaded)
        except PdserveError as exc:
            print(f"pdserve: {exc}", file=sys.stderr)
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
