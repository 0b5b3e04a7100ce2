"""The engine's one frozen, typed config, validated at start-up.

Every field is settable three ways, later ones winning: its default, the env var ``PDSERVE_<FIELD>``
(upper case), and the CLI flag ``--field-name``. An unknown ``PDSERVE_*`` variable is an error that
suggests the nearest valid name: a typo must never silently disable a watchdog. ``sources`` records
where each value came from ("default", "env", "flag"), shown by tools/inspect (secret fields hidden).
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from pdserve.errors import ConfigError

ENV_PREFIX = "PDSERVE_"


def _positive(value: Any) -> bool:
    return value > 0


def _non_negative(value: Any) -> bool:
    return value >= 0


def _port(value: int) -> bool:
    return 0 <= value <= 65535


def _setting(default: Any, help: str, rule: Callable[[Any], bool] | None = None, rule_text: str = "",
             choices: Sequence[str] | None = None, secret: bool = False, repeatable: bool = False) -> Any:
    """A config field. ``secret``: its value is never shown (tools/inspect, the manifest); ``repeatable``: the
    CLI flag may be given several times, the values joined with commas (the env var takes them comma-separated)."""
    return field(default=default, metadata={"help": help, "rule": rule, "rule_text": rule_text,
                                            "choices": choices, "secret": secret, "repeatable": repeatable})


@dataclass(frozen=True)
class EngineConfig:
    """All engine settings. Units are in the names; every timeout is in seconds."""

    # model and serving
    model: str = _setting("", "GGUF file or HF Llama directory; empty = the embedded SmolLM2-135M-Instruct")
    served_model_name: str = _setting("", "name listed by /v1/models; several (comma-separated, or the flag "
                                      "repeated) are aliases, each accepted as 'model', the first reported; * among "
                                      "them accepts any name (as llama-server does); empty = the model's own name",
                                      repeatable=True)
    host: str = _setting("127.0.0.1", "address the HTTP server binds")
    port: int = _setting(8000, "TCP port of the HTTP server (0 = pick a free one)", _port, "0..65535")
    keep_alive_timeout_s: float = _setting(120.0, "idle HTTP connections are closed after this (HTTP/1.1 close, "
                                           "HTTP/2 GOAWAY); keep it above the idle timeout of the connection pools "
                                           "in front (nginx and cloud load balancers 60 s, Go's net/http 90 s): "
                                           "the server must outlive the client's pool (README)",
                                           _positive, "> 0")
    sse_ping_interval_s: float = _setting(15.0, "a stream that sent nothing this long (queueing, a long prefill) "
                                          "gets an SSE comment ': ping' so proxies do not time it out; 0 = off",
                                          _non_negative, ">= 0")
    connection_ledger_rows: int = _setting(256, "open HTTP connections the connection ledger records (shm, read "
                                           "by tools/inspect --connections); 0 = no ledger", _non_negative, ">= 0")
    connection_ledger_closed_rows: int = _setting(64, "closed connections the ledger keeps (a ring)", _positive,
                                                  "> 0")
    http_stall_s: float = _setting(10.0, "the monitor reports a response the engine finished but that is not "
                                   "written, a write blocked on the client, or a request with no response started "
                                   "after this long", _positive, "> 0")
    body_read_timeout_s: float = _setting(30.0, "longest wait for the next bytes of a request body before a 408 "
                                          "(a client that stops sending mid-body cannot hold a handler)",
                                          _positive, "> 0")
    ssl_certfile: str = _setting("", "TLS certificate (PEM); with ssl_keyfile serves HTTP/2 (ALPN h2) and "
                                     "HTTP/1.1 over TLS")
    ssl_keyfile: str = _setting("", "TLS private key (PEM)")
    ssl_ca_certs: str = _setting("", "with ssl_certfile: CA bundle (PEM) whose certificates clients must present "
                                 "(mutual TLS: a node that only its router, holding node_client_cert, may reach); "
                                 "empty = no client certificate asked")
    api_key: str = _setting("", "API key(s) required as 'Authorization: Bearer KEY' on /v1/* and "
                                "/debug/state (comma-separated, or the flag repeated); empty (and no api_key_file) = "
                                "no authentication",
                            secret=True, repeatable=True)
    allowed_origins: str = _setting("", "CORS: origins (comma-separated, or the flag repeated; * = any) whose "
                                    "browser pages may call the API (preflight OPTIONS answered); empty = no CORS",
                                    repeatable=True)
    api_key_file: str = _setting("", "file of API keys, one per line ('#' starts a comment); added to api_key")
    admin_key: str = _setting("", "admin key(s): valid wherever an API key is, and the only keys that read "
                              "/debug/* (every request's row and timeline) once any key is configured "
                              "(comma-separated, or the flag repeated)", secret=True, repeatable=True)
    admin_key_file: str = _setting("", "file of admin keys, one per line ('#' starts a comment); added to admin_key")
    node_secret: str = _setting("", "router <-> node secret: the only credential /internal/* accepts on a node "
                                "(--role prefill|decode), sent by `pdserve router` on every call; never a valid "
                                "API key; at least 16 characters (prefer node_secret_file: a flag shows in ps)",
                                secret=True)
    node_secret_file: str = _setting("", "file holding node_secret (its first non-comment line)")
    insecure_nodes: bool = _setting(False, "allow what node_secret and TLS otherwise guard: a node or router "
                                    "without node_secret (a node's /internal/* then open to whoever reaches its "
                                    "port), and the router's cleartext http:// to a node that is not on loopback")
    node_ca: str = _setting("", "router: CA bundle (PEM) that verifies https:// nodes' certificates; empty = the "
                            "system's trust store (SSL_CERT_FILE / SSL_CERT_DIR honoured)")
    node_client_cert: str = _setting("", "router: client certificate (PEM) presented to https:// nodes (whose "
                                     "ssl_ca_certs asks for one); with node_client_key")
    node_client_key: str = _setting("", "router: the private key (PEM) of node_client_cert")
    chat_template: str = _setting("", "jinja2 chat template file replacing the model's own (e.g. one that "
                                      "renders 'tools'); empty = the model's template")
    tool_call_parser: str = _setting("auto", "format of the model's tool calls in chat answers (api/formats.py); "
                                     "auto = by the model's family (README)",
                                     choices=("auto", "hermes", "llama3_json", "mistral", "deepseek_v3",
                                              "deepseek_v31"))
    reasoning_parser: str = _setting("auto", "format of the model's reasoning, returned as reasoning_content "
                                     "(api/formats.py); auto = by the model's family, none = no split",
                                     choices=("auto", "none", "qwen3", "deepseek_r1"))
    tool_calls_in_reasoning: str = _setting("call", "a complete tool call the model writes before its reasoning "
                                            "ends: call = returned as a tool call (as SGLang), reasoning = left in "
                                            "reasoning_content (as vLLM)", choices=("call", "reasoning"))
    strict_fields: bool = _setting(False, "Responses and Messages requests: an unknown field, input item or tool "
                                          "type is a 400 (default: accepted, logged once per name at WARNING and "
                                          "counted in pdserve_unknown_request_fields_total)")
    device: str = _setting("cpu", "device of both actors", choices=("cpu", "cuda"))
    colocated: bool = _setting(False, "one decode actor also prefills (no prefill actor, no KV handoff); for "
                                      "comparing with disaggregation")
    prefill_actors: int = _setting(1, "prefill actors (processes; each its own KV pool and inbox); ignored when "
                                   "colocated", _positive, "> 0")
    decode_actors: int = _setting(1, "decode actors (processes; each its own KV pool and inbox)", _positive, "> 0")
    prefill_devices: str = _setting("", "device cuda: comma-separated GPU ordinals, one prefill actor each "
                                    "(e.g. 0,1; sets prefill_actors); empty = prefill_actors on device 0")
    decode_devices: str = _setting("", "device cuda: comma-separated GPU ordinals, one decode actor each "
                                   "(e.g. 2,3; sets decode_actors); empty = decode_actors on device 0")
    weights: str = _setting("auto", "how linear weights are held: auto = a GGUF's Q4_0/Q4_1 (int4) and Q8_0 "
                            "(int8) weights stay quantized on CPU, decode steps run them on int8-quantized inputs as "
                            "llama.cpp does (3-5x faster decode; batch-invariant: a greedy answer is the same alone, "
                            "in a batch, packed or from the prefix cache); float32 / bfloat16 = "
                            "dequantized (float32 equals HF transformers token for token)",
                            choices=("auto", "float32", "bfloat16"))
    prefill_low_bit: bool = _setting(False, "weights auto on CPU: prefill prompts on the low-bit kernels too, as "
                                     "llama.cpp does (int8-quantized inputs; batch-invariant; about 0.6x the prefill "
                                     "time of the exact float32 copies it runs otherwise), at a cost in answers at "
                                     "near ties: the embedded model then answers 'What is the capital of France?' "
                                     "as llama-server does on the same file, \"L'Etoile, la Marseillaise...\", "
                                     "instead of Paris")
    model_cache_dir: str = _setting("", "where prepared models are cached (built once, memory-mapped by every "
                                    "actor); empty = ~/.cache/pdserve/models; off = no cache")
    torch_threads: int = _setting(1, "torch intra-op threads per actor (prefill and decode run in parallel)",
                                  _positive, "> 0")
    decode_threads: int = _setting(0, "native low-bit weights on CPU: threads a decode step's GEMVs and per-row "
                                   "attention split over (the bits do not change); 0 = auto: one under 4 rows, "
                                   "else the CPUs this process may use, less torch_threads per prefill actor with "
                                   "work, shared among the decode actors (an idle prefill actor's core decodes)",
                                   _non_negative, ">= 0")
    prefill_threads: int = _setting(0, "native low-bit weights on CPU: torch threads a prefill pass's float32 GEMMs "
                                    "run on where they give the bits of one thread (gpu.model.gemm_plan, probed at "
                                    "start-up; the other ops stay on torch_threads); 0 = auto: torch_threads while a decode actor of "
                                    "this node has work, else the CPUs this process may use, shared among the "
                                    "prefill actors (an idle decode actor's core prefills)",
                                    _non_negative, ">= 0")
    kv_transport: str = _setting("cpu-shm", "KV handoff transport: cpu-shm (one host, shared memory), mooncake "
                                 "(the Mooncake Transfer Engine over TCP; pip install .[mooncake], see README), "
                                 "cuda-ipc (device cuda: GPU pools through CUDA IPC; the default there) or "
                                 "torch-ipc (its CPU twin: CPU tensor pools shared through torch)",
                                 choices=("cpu-shm", "mooncake", "cuda-ipc", "torch-ipc"))
    attention_backend: str = _setting("torch", "attention kernels of the model: torch (SDPA over the paged pool; "
                                      "any device), numba (gpu/kernels paged attention; device cuda) or mma (its "
                                      "tensor-core tiles: bf16, device cuda)", choices=("torch", "numba", "mma"))
    role: str = _setting("both", "what this node runs: both = prefill and decode actors (one host); prefill or "
                         "decode = one side of a multi-node deployment, reached by `pdserve router` (its KV goes "
                         "over kv_transport=mooncake)", choices=("both", "prefill", "decode"))
    kv_transfer_host: str = _setting("127.0.0.1", "address this node's Mooncake transfer engine listens on and "
                                     "advertises (kv_transport=mooncake): the node's data-network address when "
                                     "prefill and decode run on different hosts")
    autotune_cache: str = _setting("", "target_ctas autotune cache file (JSON; see docs/gpu.md); empty = "
                                   "~/.cache/pdserve/autotune.json")
    # KV cache and batching
    kv_block_tokens: int = _setting(16, "tokens per KV block (page)", _positive, "> 0")
    kv_pool_tokens: int = _setting(0, "tokens each actor's KV pool holds; 0 = auto: twice the model's context, "
                                   "capped so that the node's pools take at most a quarter of the memory available "
                                   "at start-up (the chosen size is logged; pdserve.kv_budget.auto_pool_tokens)",
                                   _non_negative, ">= 0")
    kv_cache_dtype: str = _setting("auto", "element type of the KV cache: auto = float16 with weights auto on CPU "
                                   "(half the bytes a decode step reads and a handoff moves; the native path is not "
                                   "HF-exact anyway), else float32 (weights float32 equals HF token for token; the "
                                   "CUDA kernels read float32); float16 = on CPU whatever the weights",
                                   choices=("auto", "float32", "float16"))
    max_model_len: int = _setting(0, "longest prompt + output in tokens; 0 = min(model context, pool)",
                                  _non_negative, ">= 0")
    prefix_cache: bool = _setting(True, "keep full blocks of prompt KV in the prefill pool after a request ends and "
                                  "reuse them for prompts that start with the same tokens (--no-prefix-cache: off)")
    kv_hand_back: bool = _setting(True, "with the prefix cache: a decode actor hands a finished request's prompt + "
                                  "answer KV back to the prefill actor that served it, whose prefix cache keeps it "
                                  "for the conversation's next turn (cpu-shm and colocated; --no-kv-hand-back: off)")
    cache_routing_max_imbalance_tokens: int = _setting(2048, "with several prefill actors a prompt goes to the one "
                                                       "caching its longest prefix unless that one's queued prompt "
                                                       "tokens exceed the least-queued actor's by more than this; "
                                                       "then to the longest cached prefix among those within it "
                                                       "(0 = the cache only breaks ties of load)",
                                                       _non_negative, ">= 0")
    prefill_chunk_tokens: int = _setting(128, "most tokens of one prompt in one prefill forward pass (a longer "
                                         "prompt advances a chunk per pass, beside other prompts)",
                                         _positive, "> 0")
    max_prefill_batch_tokens: int = _setting(512, "most prompt tokens one prefill forward pass packs (over all "
                                             "queued prompts, FIFO); between passes the prefill actor beats its "
                                             "heartbeat and drops requests aborted meanwhile", _positive, "> 0")
    max_num_seqs: int = _setting(32, "most requests in the decode batch", _positive, "> 0")
    max_queued_requests: int = _setting(256, "admitted but unfinished sequences (each of n choices counts) before 503",
                                        _positive, "> 0")
    reserve_output_tokens: int = _setting(256, "output tokens decode reserves KV blocks for when it takes a request "
                                          "without max_tokens (whose answer may run to the end of the context, "
                                          "max_model_len - prompt): more blocks are taken one at a time as the "
                                          "answer grows, and it ends with finish_reason length if the pool has none "
                                          "free; a request with max_tokens reserves prompt + max_tokens up front",
                                          _positive, "> 0")
    max_tokens_policy: str = _setting("reject", "an explicit max_tokens over the context the prompt leaves: reject = "
                                      "a 400 (as vLLM), clamp = the rest of the context (as llama.cpp; then reserved "
                                      "like a request without max_tokens)", choices=("reject", "clamp"))
    pooling: str = _setting("last", "how /v1/embeddings pools the final hidden states (after the final norm) of "
                            "an input, L2-normalised: last = the last token's, the one token that has read the whole "
                            "input under causal attention (vLLM's default for a decoder), mean = the mean over its "
                            "tokens", choices=("last", "mean"))
    queue_slots: int = _setting(512, "slots in each shm message queue", _positive, "> 0")
    queue_slot_bytes: int = _setting(131072, "bytes per shm queue slot (largest message)", _positive, "> 0")
    idle_wait_s: float = _setting(0.5, "longest an actor loop (and the API's inbox thread and heartbeat loop) "
                                  "blocks on its inbox before it beats its heartbeat and checks for stop; a message "
                                  "wakes it at once, so this bounds idle CPU and stop latency, not request latency",
                                  _positive, "> 0")
    queue_put_timeout_s: float = _setting(5.0, "longest an engine actor blocks on a full shm queue (its consumer "
                                          "slow, hung or dead) before it holds the message and retries it every "
                                          "loop iteration, later messages to that queue behind it",
                                          _positive, "> 0")
    admission_put_timeout_s: float = _setting(1.0, "longest the API waits for room in the prefill queue before "
                                              "it answers 503 (retry)", _positive, "> 0")
    # deadlines (the heartbeat monitor enforces them)
    request_timeout_s: float = _setting(600.0, "deadline of a whole request", _positive, "> 0")
    monitor_tick_s: float = _setting(0.5, "heartbeat monitor period", _positive, "> 0")
    queue_timeout_s: float = _setting(60.0, "deadline in QUEUED (waiting for prefill)", _positive, "> 0")
    prefill_timeout_s: float = _setting(60.0, "deadline in PREFILLING", _positive, "> 0")
    bootstrap_timeout_s: float = _setting(30.0, "deadline in BOOTSTRAP (decode reserving KV blocks)",
                                          _positive, "> 0")
    inflight_timeout_s: float = _setting(60.0, "deadline in TRANSFERRING (prefill inflight queue)",
                                         _positive, "> 0")
    decode_waiting_timeout_s: float = _setting(60.0, "deadline in DECODE_WAITING (decode admission)",
                                               _positive, "> 0")
    decode_stall_timeout_s: float = _setting(30.0, "longest gap between two tokens in DECODING", _positive,
                                             "> 0")
    actor_hang_timeout_s: float = _setting(10.0, "heartbeat age after which a live actor counts as hung",
                                           _positive, "> 0")
    stuck_gauge_s: float = _setting(30.0, "a gauge > 0 with nothing leaving its stage this long is stuck",
                                    _positive, "> 0")
    drill_interval_s: float = _setting(120.0, "watchdog fire drill (api/drill.py): this often the API sends the "
                                       "engine a tiny request per stage, held there by a fault, one at a time, and "
                                       "checks the stage deadline fires within drill_timeout_s + one tick and frees "
                                       "its KV blocks; a drill waits while other requests are live; 0 = off",
                                       _non_negative, ">= 0")
    drill_timeout_s: float = _setting(1.0, "the stage deadline of drill requests (instead of the stage's own)",
                                      _positive, "> 0")
    eject_timeouts: int = _setting(3, "stage-aware ejection (actors/ejection.py): an engine actor whose requests time "
                                   "out this many times in the same stage within eject_window_s (a stuck gauge "
                                   "counts as one) is drained: it takes no new work, its running requests go on; "
                                   "never the last serving actor of its role; 0 = off", _non_negative, ">= 0")
    eject_window_s: float = _setting(60.0, "the window eject_timeouts are counted in", _positive, "> 0")
    eject_readmit_s: float = _setting(300.0, "with no watchdog drills to readmit a drained actor (drill_interval_s "
                                      "0, or a node of one side) it is readmitted after this long drained; with "
                                      "drills, a passing drill on it readmits it (api/drill.py)", _positive, "> 0")
    eject_probe_interval_s: float = _setting(10.0, "`pdserve router`: a node it drained (eject_timeouts of one stage) "
                                             "gets a probe, a tiny real request through it, at once and then this "
                                             "often until one answers; that readmits it", _positive, "> 0")
    recorder_events: int = _setting(262144, "flight recorder: events kept in its shm ring (64 B each, split evenly "
                                    "between the writer processes; the oldest are overwritten; tools/inspect "
                                    "--request reads it); 0 = off", _non_negative, ">= 0")
    arrival_index_entries: int = _setting(131072, "arrival index: the last N POST requests' ids, arrival times and "
                                          "statuses (56 B each; ipc/arrivals.py), so tools/inspect --request tells "
                                          "an id that never reached the server from one whose recorder events were "
                                          "overwritten; 0 = off", _non_negative, ">= 0")
    otlp_traces_endpoint: str = _setting("", "OpenTelemetry collector URL (OTLP over HTTP, protobuf) each finished "
                                         "request's trace is exported to: its HTTP span and one span per stage, "
                                         "from the flight recorder; a URL without a path gets /v1/traces (as "
                                         "http://collector:4318); needs pip install .[otel] (README); empty = off")
    incident_dir: str = _setting("", "directory the monitor writes an incident bundle into (a tar.gz: the inspect "
                                 "snapshot, the involved requests' timelines, config, versions, its recent log "
                                 "lines, a replay recipe; tools/inspect --bundle DIR reads them) when it times a "
                                 "request out or flags a dead/hung actor, a stuck gauge, a count mismatch or a "
                                 "leaked KV block, and the API when a watchdog drill fails or a conservation check "
                                 "names an id or a connection; empty = off")
    incident_min_interval_s: float = _setting(60.0, "at most one incident bundle this often (the incidents in "
                                              "between are counted in the next one)", _non_negative, ">= 0")
    incident_dir_max_bytes: int = _setting(256 << 20, "the incident bundles kept in incident_dir: the oldest are "
                                           "deleted beyond this total", _positive, "> 0")
    faults: str = _setting("", "fault injection spec (see pdserve/faults.py); empty = none")
    drain_timeout_s: float = _setting(10.0, "on SIGTERM, how long running requests may finish", _non_negative,
                                      ">= 0")
    actor_ready_timeout_s: float = _setting(300.0, "how long an actor may take to load and report ready",
                                            _positive, "> 0")
    log_level: str = _setting("info", "logging level", choices=("debug", "info", "warning", "error"))

    @property
    def field_names(self) -> list[str]:
        return [f.name for f in dataclasses.fields(self)]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _validate_value(f: dataclasses.Field, value: Any) -> None:
    rule, choices = f.metadata.get("rule"), f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ConfigError(f"config field {f.name}={value!r}: must be one of {', '.join(choices)}", param=f.name)
    if rule is not None and not rule(value):
        raise ConfigError(f"config field {f.name}={value!r}: must be {f.metadata['rule_text']}", param=f.name)


def _coerce(f: dataclasses.Field, raw: Any, source: str) -> Any:
    kind = type(f.default)
    if isinstance(raw, (list, tuple)) and f.metadata.get("repeatable"):   # a repeated flag
        raw = ",".join(str(v) for v in raw)
    if isinstance(raw, kind) and not (kind is int and isinstance(raw, bool)):
        return raw
    try:
        if kind is bool:
            text = str(raw).strip().lower()
            if text not in ("1", "0", "true", "false", "yes", "no"):
                raise ValueError(text)
            return text in ("1", "true", "yes")
        return kind(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"config field {f.name}={raw!r} (from {source}): not a valid {kind.__name__}",
                          param=f.name) from None


@dataclass(frozen=True)
class LoadedConfig:
    config: EngineConfig
    sources: dict[str, str]


def _fields() -> list[dataclasses.Field]:
    return list(dataclasses.fields(EngineConfig))


def check_env(env: Mapping[str, str]) -> dict[str, str]:
    """Return ``{field: raw value}`` for every ``PDSERVE_*`` variable; raise ConfigError on an unknown one.

    ``PDSERVE_FAULTS`` and ``PDSERVE_ENGINE_ID``-style names that are not config fields are errors too:
    every accepted name is a field of EngineConfig.
    """
    names = {f.name.upper(): f.name for f in _fields()}
    found: dict[str, str] = {}
    for key, value in env.items():
        if not key.startswith(ENV_PREFIX):
            continue
        suffix = key[len(ENV_PREFIX):]
        if suffix not in names:
            guess = difflib.get_close_matches(suffix, list(names), n=1, cutoff=0.5)
            hint = f"; did you mean {ENV_PREFIX}{guess[0]}?" if guess else ""
            raise ConfigError(f"unknown environment variable {key}{hint} (valid: PDSERVE_ + a config field)",
                              param=key)
        found[names[suffix]] = value
    return found


def add_arguments(parser: argparse.ArgumentParser, only: tuple[str, ...] = ()) -> None:
    """Add one ``--field-name`` flag per config field (``only``: just those fields; default None so we can tell
    'not given'); a bool field that defaults to true also gets ``--no-field-name`` (the same as ``--field-name
    false``), one that defaults to false may be given alone (``--field-name`` = ``--field-name true``)."""
    for f in _fields():
        if only and f.name not in only:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = "" if f.metadata.get("secret") else repr(f.default)
        if f.default is False:   # --flag alone means true (as --insecure-nodes reads); --flag false still works
            parser.add_argument(flag, dest=f.name, default=None, nargs="?", const="true",
                                help=f"{f.metadata['help']} [{default}]")
            continue
        parser.add_argument(flag, dest=f.name, default=None, help=f"{f.metadata['help']} [{default}]",
                            action="append" if f.metadata.get("repeatable") else "store")
        if f.default is True:
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_const",
                                const="false", help=f"same as {flag} false")


def load_config(flags: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> LoadedConfig:
    """Build and validate the config from defaults, ``env`` (default os.environ) and ``flags``.

    Raises:
        ConfigError: naming the field, the value and the rule it broke, or an unknown PDSERVE_* name.
    """
    env_values = check_env(os.environ if env is None else env)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in _fields():
        value, source = f.default, "default"
        if f.name in env_values:
            value, source = _coerce(f, env_values[f.name], "env"), "env"
        if flags is not None and flags.get(f.name) is not None:
            value, source = _coerce(f, flags[f.name], "flag"), "flag"
        _validate_value(f, value)
        values[f.name] = value
        sources[f.name] = source
    from pdserve.faults import parse_faults

    parse_faults(values["faults"])  # an unknown fault is a start-up error, never silently ignored
    if values["device"] == "cuda" and sources["kv_transport"] == "default":
        values["kv_transport"] = "cuda-ipc"   # a GPU pool moves through CUDA IPC; cpu-shm is the CPU default
    config = EngineConfig(**values)
    _check_device_path(config)
    _check_kv_transport(config)
    _check_otlp(config)
    _check_api_key(config, sources["api_key"])
    api_keys(config)   # an unreadable or empty key file is a start-up error, not an open server
    admin_keys(config)
    _check_node_secret(config)
    _check_tls_files(config)
    if config.chat_template and not os.path.isfile(config.chat_template):
        raise ConfigError(f"config field chat_template={config.chat_template!r}: no such file",
                          param="chat_template")   # whether it compiles: actors.supervisor.plan_layout
    return LoadedConfig(config, sources)


def kv_cache_dtype(config: EngineConfig) -> str:
    """The KV cache's element type, ``"float16"`` or ``"float32"``: ``kv_cache_dtype`` resolved (``auto`` =
    float16 for weights auto on CPU, the native low-bit path; float32 otherwise: the HF-exact float32 weights and
    the CUDA kernels)."""
    if config.kv_cache_dtype != "auto":
        return config.kv_cache_dtype
    return "float16" if config.device == "cpu" and config.weights == "auto" else "float32"


def _check_device_path(config: EngineConfig) -> None:
    """Raises ConfigError for a KV transport or attention backend the device cannot run: cuda-ipc needs device
    cuda, device cuda keeps KV in GPU memory (cuda-ipc), numba attention runs on cuda. Whether this host has the
    device: actors.supervisor.check_device."""
    if config.kv_transport == "cuda-ipc" and config.device != "cuda":
        raise ConfigError(f"config field kv_transport='cuda-ipc' needs device=cuda (device={config.device!r}); on "
                          f"CPU use cpu-shm or torch-ipc", param="kv_transport")
    if config.device == "cuda" and config.kv_transport != "cuda-ipc":
        raise ConfigError(f"config field kv_transport={config.kv_transport!r}: device=cuda keeps each actor's KV pool "
                          f"in GPU memory, which only cuda-ipc moves (across hosts: not wired yet); use cuda-ipc",
                          param="kv_transport")
    if config.kv_cache_dtype == "float16" and config.device == "cuda":
        raise ConfigError("config field kv_cache_dtype='float16': the CUDA path's kernels read a float32 KV cache; "
                          "use auto or float32 on device=cuda", param="kv_cache_dtype")
    if config.attention_backend != "torch" and config.device != "cuda":
        raise ConfigError(f"config field attention_backend={config.attention_backend!r} needs device=cuda "
                          f"(device={config.device!r}): the numba kernels run on a GPU; use torch",
                          param="attention_backend")


def _check_kv_transport(config: EngineConfig) -> None:
    """Raises ConfigError if the chosen KV transport cannot run (its optional library missing, or mooncake
    asked for in colocated mode, where there is no handoff to carry)."""
    if config.role != "both" and config.kv_transport != "mooncake":
        raise ConfigError(f"config field role={config.role!r}: a node of one side moves KV across hosts; give "
                          "kv_transport=mooncake", param="role")
    if config.role != "both" and config.colocated:
        raise ConfigError(f"config field role={config.role!r}: colocated mode runs both sides on one node",
                          param="role")
    if config.kv_transport != "mooncake":
        return
    if config.colocated:
        raise ConfigError("config field kv_transport='mooncake': colocated mode has no KV handoff; use cpu-shm",
                          param="kv_transport")
    try:
        import mooncake.engine  # noqa: F401  (what ipc/mooncake_transport.py needs; importing ipc here is a cycle)
    except ImportError as exc:
        raise ConfigError(f"config field kv_transport='mooncake' needs the Mooncake Transfer Engine: pip install "
                          f".[mooncake] and apt-get install libibverbs1 librdmacm1 libnuma1 ({exc})",
                          param="kv_transport") from None


def _check_otlp(config: EngineConfig) -> None:
    """Raises ConfigError if ``otlp_traces_endpoint`` is not an http(s) URL, or is given without the ``otel`` extra
    (the OpenTelemetry SDK and its OTLP/HTTP exporter) installed."""
    url = config.otlp_traces_endpoint
    if not url:
        return
    if not url.startswith(("http://", "https://")) or len(url.split("://", 1)[1].strip("/")) == 0:
        raise ConfigError(f"config field otlp_traces_endpoint={url!r}: give the collector's http:// or https:// URL "
                          "(OTLP over HTTP, as http://collector:4318)", param="otlp_traces_endpoint")
    try:
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401  (what api/tracing.py needs)
        import opentelemetry.sdk.trace  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"config field otlp_traces_endpoint={url!r} needs the OpenTelemetry SDK and its OTLP/HTTP "
                          f"exporter: pip install .[otel] ({exc})", param="otlp_traces_endpoint") from None


def _check_api_key(config: EngineConfig, source: str) -> None:
    """Raises ConfigError when ``api_key`` was given (flag or env) but holds a blank key after splitting on commas
    and stripping (``--api-key " "``, ``","``, ``PDSERVE_API_KEY=`` from an unset shell variable): that would
    start an open server without a word. The message names the flag or variable, never the keys."""
    if source not in ("flag", "env"):
        return
    entries = config.api_key.split(",")
    blank = [i for i, k in enumerate(entries) if not k.strip()]
    if blank:
        name = "--api-key" if source == "flag" else f"{ENV_PREFIX}API_KEY"
        raise ConfigError(f"{name} holds a blank API key (entry {blank[0] + 1} of {len(entries)} after splitting on "
                          f"commas is empty or spaces); give real keys, or leave {name} out for an open server",
                          param="api_key")


def _key_lines(path: str, field_name: str) -> list[str]:
    """The keys in file ``path`` (one per line; blank lines and ``#`` comments skipped). Raises ConfigError naming
    ``field_name`` when it cannot be read or holds none."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
    except OSError as exc:
        raise ConfigError(f"config field {field_name}={path!r}: cannot read it ({exc})", param=field_name) from None
    found = [line for line in lines if line and not line.startswith("#")]
    if not found:
        raise ConfigError(f"config field {field_name}={path!r}: holds no key (one per line)", param=field_name)
    return found


def api_keys(config: EngineConfig) -> tuple[str, ...]:
    """The API keys ``config`` asks for: ``api_key`` (comma-separated) plus the lines of ``api_key_file``
    (blank lines and ``#`` comments skipped). Empty (and no admin keys) = no authentication.

    Raises:
        ConfigError: the key file cannot be read or holds no key.
    """
    keys = [k.strip() for k in config.api_key.split(",") if k.strip()]
    if config.api_key_file:
        keys += _key_lines(config.api_key_file, "api_key_file")
    return tuple(dict.fromkeys(keys))


def admin_keys(config: EngineConfig) -> tuple[str, ...]:
    """The admin keys: ``admin_key`` (comma-separated) plus the lines of ``admin_key_file``. Raises ConfigError as
    ``api_keys``."""
    keys = [k.strip() for k in config.admin_key.split(",") if k.strip()]
    if config.admin_key_file:
        keys += _key_lines(config.admin_key_file, "admin_key_file")
    return tuple(dict.fromkeys(keys))


MIN_NODE_SECRET_CHARS = 16


def node_secret(config: EngineConfig) -> str:
    """The router <-> node secret: ``node_secret``, else the first line of ``node_secret_file``; "" when neither is
    given. Raises ConfigError when the file cannot be read or holds none."""
    if config.node_secret.strip():
        return config.node_secret.strip()
    if config.node_secret_file:
        return _key_lines(config.node_secret_file, "node_secret_file")[0]
    return ""


def _check_node_secret(config: EngineConfig) -> None:
    """Raises ConfigError when a node (role prefill or decode) has no node secret and ``insecure_nodes`` is not
    set (its /internal/* routes would take orders from anyone who reaches the port), when the secret is shorter
    than MIN_NODE_SECRET_CHARS, or when it equals an API or admin key (it must never open the public routes).
    The router checks its own side in pdserve.cli.node_urls. Refused rather than generated: the router must hold
    the same value, and a secret printed at start-up for copying ends up in logs; refused rather than open: a
    node's port reachable from the network would otherwise take aborts from anyone (an explicit --insecure-nodes
    keeps that choice available, and visible in the command line)."""
    secret = node_secret(config)
    if config.role != "both" and not secret and not config.insecure_nodes:
        raise ConfigError(f"config field role={config.role!r}: a node takes /internal/* calls only with "
                          "node_secret (give --node-secret-file FILE here and to `pdserve router`), or run it "
                          "open with --insecure-nodes", param="node_secret")
    if secret and len(secret) < MIN_NODE_SECRET_CHARS:
        raise ConfigError(f"config field node_secret: {len(secret)} characters; give at least "
                          f"{MIN_NODE_SECRET_CHARS} (e.g. python -c 'import secrets; print(secrets.token_hex(32))')",
                          param="node_secret")
    if secret and secret in api_keys(config) + admin_keys(config):
        raise ConfigError("config field node_secret equals an API or admin key; give the nodes a secret of their "
                          "own", param="node_secret")


def _check_tls_files(config: EngineConfig) -> None:
    """Raises ConfigError for a TLS file that does not exist or a certificate given without its key."""
    for name in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "node_ca", "node_client_cert", "node_client_key"):
        path = getattr(config, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"config field {name}={path!r}: no such file", param=name)
    for cert, key in (("ssl_certfile", "ssl_keyfile"), ("node_client_cert", "node_client_key")):
        if bool(getattr(config, cert)) != bool(getattr(config, key)):
            raise ConfigError(f"config fields {cert} and {key} go together; give both or neither", param=cert)
    if config.ssl_ca_certs and not config.ssl_certfile:
        raise ConfigError("config field ssl_ca_certs (client certificates) needs ssl_certfile and ssl_keyfile (TLS)",
                          param="ssl_ca_certs")


def allowed_origins(config: EngineConfig) -> tuple[str, ...]:
    """The CORS origins ``config`` allows (``allowed_origins``, comma-separated); empty = no CORS."""
    return tuple(dict.fromkeys(o.strip() for o in config.allowed_origins.split(",") if o.strip()))


def redacted(config: EngineConfig) -> dict[str, Any]:
    """``config.to_dict()`` with secret fields replaced by a note of how many values they hold."""
    out = config.to_dict()
    for f in _fields():
        if f.metadata.get("secret") and out[f.name]:
            out[f.name] = f"<{len([v for v in str(out[f.name]).split(',') if v.strip()])} hidden>"
    return out
