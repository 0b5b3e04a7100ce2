"""Every exception pdserve raises on purpose, in one place.

Messages say what happened and what to do about it. Each class carries the OpenAI error ``type`` and
the HTTP status the API answers with when the error reaches a client.
"""
from __future__ import annotations


class PdserveError(Exception):
    """Base class. ``http_status`` and ``error_type`` map the error onto an OpenAI error response."""

    http_status = 500
    error_type = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ConfigError(PdserveError, ValueError):
    """A config field has a value outside its rule (raised at start-up, before any process is spawned)."""

    error_type = "invalid_config"


class InvalidRequestError(PdserveError):
    """The client sent something we will not run (bad JSON, wrong type, out of range, too long)."""

    http_status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(InvalidRequestError):
    http_status = 404
    error_type = "not_found_error"


class ModelLoadError(PdserveError):
    """The model file or directory cannot be read; the message names the path and the missing piece."""

    error_type = "model_load_error"


class EngineOverloadedError(PdserveError):
    """Admission queues are full; retry after a short wait."""

    http_status = 503
    error_type = "overloaded_error"


class RequestTimeoutError(PdserveError):
    """A request passed the deadline of one lifecycle stage; the message names the stage and the age."""

    http_status = 504
    error_type = "timeout_error"


class RequestFailedError(PdserveError):
    """An actor failed or dropped the request; retrying is safe."""

    http_status = 503
    error_type = "engine_error"


class QueueFullError(PdserveError):
    """A shared-memory queue stayed full past the put timeout (the consumer is slow, hung or dead)."""


class ShmLockTimeoutError(PdserveError):
    """A shared-memory lock stayed held past its timeout by a process that is still alive (stopped or hung).

    The message names the lock, the holder pid and whether it is alive; the usual fix is to restart (or
    SIGCONT) that process. A holder that died is taken over automatically and never raises this.
    """


class QueueClosedError(PdserveError):
    """The queue's segment is gone (the engine is shutting down)."""


class QueueRoleError(PdserveError):
    """A second live process tried to produce into (or consume from) a single-producer/single-consumer queue.

    The message names the queue, the role and the pid that holds it; create the queue with ``mode="mpmc"``
    if it really has several producers (or consumers), or stop that process first.
    """


class MessageTooLargeError(PdserveError):
    """A message does not fit one queue slot; raise the queue's ``slot_bytes`` or send less."""


class OutOfKVBlocksError(PdserveError):
    """The KV pool has fewer free blocks than asked for; the caller keeps the request waiting."""


class KVBlockStateError(PdserveError):
    """A block id was freed twice, freed by a non-owner, or carries a stale generation: a bug, never ignored."""


class StateTableFullError(PdserveError):
    """Every row of the request state table is live; admission must wait."""

    http_status = 503
    error_type = "overloaded_error"
