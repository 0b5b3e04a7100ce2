"""``pdserve`` command line: ``pdserve serve [--model PATH] [--port P] [--role prefill|decode] ...`` (every config
field is a flag) and ``pdserve router --prefill-node URL --decode-node URL ...`` (api/router_server.py)."""
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
    router = sub.add_parser("router", help="the OpenAI API in front of prefill and decode nodes (serve --role ...)",
                            description="Routes each request to a prefill node and a decode node; the config "
                                        "flags give its HTTP server, model (tokenizer, limits) and deadlines.")
    for role in ("prefill", "decode"):
        router.add_argument(f"--{role}-node", dest=f"{role}_nodes", action="append", default=[], metavar="URL",
                            help=f"base URL of a `pdserve serve --role {role}` node (repeatable)")
    add_arguments(router, ROUTER_FIELDS)
    return parser


# the config fields `pdserve router` uses: its HTTP server, the model's tokenizer and limits, deadlines, keys, traces
ROUTER_FIELDS = ("model", "served_model_name", "host", "port", "keep_alive_timeout_s", "body_read_timeout_s",
                 "api_key", "api_key_file", "chat_template", "model_cache_dir", "kv_block_tokens", "kv_pool_tokens",
                 "max_model_len", "reserve_output_tokens", "max_tokens_policy", "max_queued_requests",
                 "request_timeout_s", "allowed_origins", "monitor_tick_s", "actor_hang_timeout_s", "log_level",
                 "otlp_traces_endpoint", "tool_calls_in_reasoning", "strict_fields")


def node_urls(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The router's node lists. Raises ConfigError for a missing role or a URL that is not http(s)://host:port."""
    from urllib.parse import urlsplit

    lists = []
    for role in ("prefill", "decode"):
        urls = getattr(args, f"{role}_nodes")
        if not urls:
            raise ConfigError(f"the router needs at least one --{role}-node URL", param=f"{role}_node")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ConfigError(f"--{role}-node {url!r}: give http://HOST:PORT", param=f"{role}_node")
        lists.append(list(urls))
    return lists[0], lists[1]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        loaded = load_config(vars(args))
        urls = node_urls(args) if args.command == "router" else None
    except ConfigError as exc:
        print(f"pdserve: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=loaded.config.log_level.upper(),
                        format=f"%(asctime)s {'router' if args.command == 'router' else 'supervisor'} "
                               "%(levelname)s %(message)s")
    if args.command == "serve":
        from actors.supervisor import serve

        try:
            return serve(loaded)
        except PdserveError as exc:
            print(f"pdserve: {exc}", file=sys.stderr)
            return 1
    if args.command == "router":
        from api.router_server import run_router

        try:
            return run_router(loaded, *urls)
        except PdserveError as exc:
            print(f"pdserve: {exc}", file=sys.stderr)
            return 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
