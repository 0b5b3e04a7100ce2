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
                 "otlp_traces_endpoint", "admin_key", "admin_key_file", "node_secret", "node_secret_file",
                 "insecure_nodes", "node_ca", "node_client_cert", "node_client_key",
                 "tool_calls_in_reasoning", "strict_fields", "eject_timeouts", "eject_window_s",
                 "eject_probe_interval_s")


def loopback(host: str) -> bool:
    """``host`` (a URL's hostname) names this host's loopback: ``localhost`` or an address in 127.0.0.0/8 or ::1."""
    import ipaddress

    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def node_urls(args: argparse.Namespace, config=None) -> tuple[list[str], list[str]]:
    """The router's node lists. Raises ConfigError for a missing role, a URL that is not http(s)://host:port, and
    (``config``: the router's EngineConfig) unless ``config.insecure_nodes``: a cleartext ``http://`` node that is
    not on loopback (its calls would carry the node secret and the prompts in the clear), or no node_secret."""
    from urllib.parse import urlsplit

    from pdserve.config import node_secret

    lists = []
    for role in ("prefill", "decode"):
        urls = getattr(args, f"{role}_nodes")
        if not urls:
            raise ConfigError(f"the router needs at least one --{role}-node URL", param=f"{role}_node")
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
                raise ConfigError(f"--{role}-node {url!r}: give http://HOST:PORT", param=f"{role}_node")
            if (config is not None and not config.insecure_nodes and parts.scheme == "http"
                    and not loopback(parts.hostname)):
                raise ConfigError(f"--{role}-node {url!r}: cleartext to another host; serve the node over TLS "
                                  "(--ssl-certfile/--ssl-keyfile there, https:// and --node-ca here), or allow it "
                                  "with --insecure-nodes", param=f"{role}_node")
        lists.append(list(urls))
    if config is not None and not config.insecure_nodes and not node_secret(config):
        raise ConfigError("the router needs the nodes' node_secret (--node-secret-file FILE, as given to each "
                          "node), or --insecure-nodes for nodes started without one", param="node_secret")
    return lists[0], lists[1]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        loaded = load_config(vars(args))
        urls = node_urls(args, loaded.config) if args.command == "router" else None
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
