"""API keys in the config (flags, env, key file; never shown), the bearer check, --chat-template validation, and
the default served model name."""
from __future__ import annotations

import argparse

import pytest

from api.middleware import ApiKeyMiddleware
from gpu.model_files import model_file_name
from pdserve.config import add_arguments, api_keys, load_config, redacted
from pdserve.errors import ConfigError


def flags(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args(argv))


def test_keys_come_from_repeated_flags_the_env_and_a_key_file(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nsk-file-1\n\n  sk-file-2  \n")
    loaded = load_config(flags("--api-key", "sk-a", "--api-key", "sk-b,sk-c", "--api-key-file", str(key_file)), env={})
    assert api_keys(loaded.config) == ("sk-a", "sk-b", "sk-c", "sk-file-1", "sk-file-2")
    assert api_keys(load_config({}, env={"PDSERVE_API_KEY": "k1,k2"}).config) == ("k1", "k2")
    assert api_keys(load_config({}, env={}).config) == ()


def test_a_missing_or_empty_key_file_stops_start_up(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config({"api_key_file": str(tmp_path / "nope")}, env={})
    assert err.value.param == "api_key_file"
    empty = tmp_path / "empty"
    empty.write_text("# nothing\n\n")
    with pytest.raises(ConfigError, match="holds no key"):
        load_config({"api_key_file": str(empty)}, env={})


def test_keys_are_never_shown_in_the_effective_config_or_the_help():
    loaded = load_config(flags("--api-key", "sk-secret-1", "--api-key", "sk-secret-2"), env={})
    shown = redacted(loaded.config)
    assert shown["api_key"] == "<2 hidden>" and "sk-secret" not in repr(shown)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert "sk-secret" not in parser.format_help()


@pytest.mark.parametrize("header,ok", [
    ("Bearer sk-right", True), ("bearer  sk-right ", True), ("Bearer sk-other", True),
    (None, False), ("", False), ("Bearer", False), ("Bearer ", False), ("sk-right", False), ("Basic sk-right", False),
    ("Bearer sk-wrong", False), ("Bearer sk-righ", False), ("Bearer sk-right-and-more", False),
    ("Bearer " + "x" * 5000, False),
])
def test_the_bearer_check_accepts_exactly_the_configured_keys(header, ok):
    assert ApiKeyMiddleware(None, ["sk-right", "sk-other"]).authorized(header) is ok


def test_a_chat_template_file_that_does_not_compile_or_exist_stops_start_up(tmp_path):
    from actors.supervisor import check_chat_template

    with pytest.raises(ConfigError) as err:
        load_config({"chat_template": str(tmp_path / "missing.jinja")}, env={})
    assert err.value.param == "chat_template"
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    assert load_config({"chat_template": str(bad)}, env={}).config.chat_template == str(bad)
    with pytest.raises(ConfigError) as err:   # what plan_layout checks before anything starts
        check_chat_template(str(bad))
    assert err.value.param == "chat_template" and "compile" in err.value.message
    good = tmp_path / "good.jinja"
    good.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    check_chat_template(str(good))


@pytest.mark.parametrize("path,name", [
    (None, "SmolLM2-135M-Instruct"),
    ("/m/SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("/m/Meta-Llama-3-8B-Instruct-Q4_K_M.gguf", "Meta-Llama-3-8B-Instruct"),
    ("/m/qwen2.5-0.5b-instruct-fp16.gguf", "qwen2.5-0.5b-instruct"),
    ("/m/tiny.gguf", "tiny"),
])
def test_the_default_served_name_is_the_model_files_own_name(path, name):
    assert model_file_name(path) == name


@pytest.mark.parametrize("configured,served", [
    ("", "SmolLM2-135M-Instruct"), ("*", "SmolLM2-135M-Instruct,*"), ("tinyllama-2,*", "tinyllama-2,*"),
    ("a,b", "a,b"),
])
def test_a_wildcard_alone_reports_the_model_files_name_and_keeps_accepting_any(configured, served):
    from actors.supervisor import served_names

    assert served_names(configured, "") == served


NODE_SECRET = "node-secret-0123456789abcdef"


@pytest.mark.parametrize("path,header,status", [
    ("/debug/state", None, 401), ("/debug/state", b"Bearer sk-wrong", 401), ("/debug/state", b"Bearer sk-right", 403),
    ("/debug/requests/r-1", b"Bearer sk-right", 403), ("/debug/state", b"Bearer sk-admin", 200),
    ("/debug/state", f"Bearer {NODE_SECRET}".encode(), 401),
    ("/v1/models", None, 401), ("/v1/models", b"Bearer sk-admin", 200), ("/v1/models", b"Bearer sk-right", 200),
    ("/v1/models", f"Bearer {NODE_SECRET}".encode(), 401),
    ("/internal/abort", None, 401), ("/internal/abort", b"Bearer sk-right", 401),
    ("/internal/abort", b"Bearer sk-admin", 401), ("/internal/abort", f"Bearer {NODE_SECRET}".encode(), 200),
    ("/health", None, 200), ("/metrics", None, 200),
])
def test_client_keys_guard_v1_admin_keys_debug_and_the_node_secret_alone_internal(path, header, status):
    """The middleware alone (the routes behind it answer 200): who may call what (api/middleware.py's table)."""
    assert guarded(ApiKeyMiddleware(answer_200, ["sk-right"], ["sk-admin"], NODE_SECRET), path, header) == status


def test_without_keys_everything_is_open_and_without_a_node_secret_internal_falls_through():
    """No key configured: /debug/* open as before; no node secret (a plain engine, whose routes then 404, or an
    --insecure-nodes node): /internal/* passes to the routes."""
    open_app = ApiKeyMiddleware(answer_200, [], [], "")
    assert [guarded(open_app, p, None) for p in ("/debug/state", "/v1/models", "/internal/abort")] == [200] * 3
    keyed = ApiKeyMiddleware(answer_200, ["sk-right"])   # keys but no admin key: nobody reads /debug/* over HTTP
    assert guarded(keyed, "/debug/state", b"Bearer sk-right") == 403
    assert guarded(keyed, "/internal/abort", b"Bearer sk-right") == 200   # the app (a plain engine) answers 404


async def answer_200(scope, receive, send):   # the routes behind the middleware
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}"})


def guarded(middleware, path: str, header: bytes | None) -> int:
    import asyncio

    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": path, "method": "GET",
             "headers": [] if header is None else [(b"authorization", header)]}
    asyncio.run(middleware(scope, receive, send))
    return sent[0]["status"]


@pytest.mark.parametrize("given, param", [
    ({"role": "prefill", "kv_transport": "mooncake"}, "node_secret"),
    ({"role": "decode", "kv_transport": "mooncake", "node_secret": "short"}, "node_secret"),
    ({"node_secret": NODE_SECRET, "api_key": NODE_SECRET}, "node_secret"),
    ({"node_secret": NODE_SECRET, "admin_key": NODE_SECRET}, "node_secret"),
    ({"node_secret_file": "/nonexistent/secret"}, "node_secret_file"),
    ({"node_client_cert": __file__}, "node_client_cert"),
    ({"node_ca": "/nonexistent/ca.pem"}, "node_ca"),
    ({"ssl_ca_certs": __file__}, "ssl_ca_certs"),
])
def test_a_node_without_a_secret_or_with_a_weak_or_shared_one_is_a_start_up_error(given, param):
    if given.get("role"):   # a node of one side needs the mooncake extra before its secret is looked at
        pytest.importorskip("mooncake.engine")
    with pytest.raises(ConfigError) as err:
        load_config(given, env={})
    assert err.value.param == param and NODE_SECRET not in str(err.value)


def test_a_node_takes_its_secret_from_a_file_or_runs_open_only_when_told(tmp_path):
    pytest.importorskip("mooncake.engine")
    from pdserve.config import node_secret

    secret_file = tmp_path / "node-secret"
    secret_file.write_text(f"# the router's and the nodes'\n{NODE_SECRET}\n")
    config = load_config({"role": "prefill", "kv_transport": "mooncake", "node_secret_file": str(secret_file)},
                         env={}).config
    assert node_secret(config) == NODE_SECRET
    assert node_secret(load_config({}, env={"PDSERVE_NODE_SECRET": NODE_SECRET}).config) == NODE_SECRET
    insecure = load_config({"role": "prefill", "kv_transport": "mooncake", "insecure_nodes": "true"}, env={}).config
    assert node_secret(insecure) == ""


@pytest.mark.parametrize("given", [{"flags": ("--api-key", " ")}, {"flags": ("--api-key", ",")},
                                   {"flags": ("--api-key", "sk-a", "--api-key", "")},
                                   {"flags": ("--api-key", "sk-a,,sk-b")},
                                   {"env": {"PDSERVE_API_KEY": ","}}, {"env": {"PDSERVE_API_KEY": ""}}])
def test_a_blank_api_key_is_a_start_up_error_naming_the_flag_or_variable(given):
    """Blank after splitting on commas and stripping: never an open server without a word."""
    with pytest.raises(ConfigError) as err:
        load_config(flags(*given.get("flags", ())), env=given.get("env", {}))
    name = "--api-key" if "flags" in given else "PDSERVE_API_KEY"
    assert err.value.param == "api_key" and name in str(err.value) and "sk-a" not in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv, env", [(["--api-key", " "], {}), ([], {"PDSERVE_API_KEY": ","})],
                         ids=["flag", "env"])
def test_serve_with_a_blank_api_key_stops_at_start_up_naming_it(argv, env):
    import os
    import subprocess
    import sys

    from tests.conftest import ROOT

    clean = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    result = subprocess.run([sys.executable, "-m", "pdserve.cli", "serve", "--port", "0", *argv], cwd=ROOT,
                            env={**clean, **env}, capture_output=True, timeout=100)
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr   # a configuration error (pdserve.cli)
    assert ("--api-key" if argv else "PDSERVE_API_KEY") in stderr and "blank API key" in stderr
