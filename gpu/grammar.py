"""Grammar-constrained decoding (structured outputs, forced tool calls) with llguidance.

A request's grammar travels on the wire as one string, the llguidance grammar (JSON text made by
:func:`json_schema_grammar` or :func:`lark_grammar`): the API checks it on admission (a grammar the library
rejects is a 400 there) and every actor that samples a token for the request builds a :class:`GrammarMatcher`
from it. The matcher state is never sent: prefill masks and samples the first token, decode rebuilds the matcher
from the grammar and the tokens generated so far (:meth:`GrammarCompiler.matcher`).

Per step, for each constrained row: ``allowed_tokens`` (the llguidance token bitmask, unpacked to one bool per
token) masks the logits in the sampler (gpu.sampling.Sampler, ``allowed=``), then ``accept(token)`` advances the
matcher. Compiling a grammar is cached per process (LRU keyed by the grammar text; a cached matcher is
deep-copied), so a decode step pays only for the masks (one per row).

Closing pressure: a sampled answer that runs into ``max_tokens`` mid-structure is cut and no longer parses. In
the last ``CLOSE_WITHIN_TOKENS + open depth`` tokens of a request's budget (:meth:`GrammarMatcher.close_within`;
the depth is the brackets open so far, so a deeply nested answer starts closing early enough to close every
level), each row's mask is narrowed to the tokens that close something whenever the grammar allows one of them at
that point: inside a JSON string, tokens made of ``"`` followed only by ``]``/``}``; elsewhere, tokens made only
of ``]``/``}``, and EOS (the matcher tracks whether the output so far ends inside a string, and the open depth).
Where the grammar allows none of them (a key or a value must come first) the mask keeps the grammar's tokens that
open no bracket, if it has any, else the grammar's mask as it is (a schema that requires an object there).
What is guaranteed: an answer whose every level can be closed by closing tokens, or by a value that opens
nothing, ends complete within ``max_tokens``; one whose schema requires more tokens than that to close (required
properties still missing at several levels) can still be cut (finish_reason ``length``).

Bounded numbers: JSON numbers have no length limit in a schema's grammar, and a model can emit digits until
``max_tokens``. Once a number outside strings has :data:`MAX_NUMBER_CHARS` characters, the mask keeps only the
grammar's tokens that do not continue it (``,``, ``}``, ``]``, EOS...) whenever it has any, so a schema
``integer`` or ``number`` ends.

Library: llguidance (guidance-ai/llguidance; the Earley parser and derivative-based lexer behind
``LLMatcher``), chosen over xgrammar for its weight (one 3 MB wheel, no dependencies; xgrammar requires
transformers, triton and apache-tvm-ffi) and for building a grammar without a per-schema precompilation pass.
"""
from __future__ import annotations

import collections
import json
import logging
import re
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from pdserve.errors import InvalidRequestError

if TYPE_CHECKING:   # torch is imported where a mask becomes a tensor: the API process checks grammars without it
    import torch

log = logging.getLogger("pdserve.grammar")

__all__ = ["GrammarCompiler", "GrammarMatcher", "json_schema_grammar", "lark_grammar", "after_reasoning",
           "schema_lark", "batch_allowed",
           "accept_tokens", "CLOSE_WITHIN_TOKENS", "MAX_GRAMMAR_BYTES", "MAX_NUMBER_CHARS"]

CLOSE_WITHIN_TOKENS = 16      # closing pressure in the last this many (+ open depth) tokens of max_tokens
MAX_NUMBER_CHARS = 24         # a JSON number ends after this many characters (see the docstring)
MAX_GRAMMAR_BYTES = 32 * 1024  # a grammar travels in shm queue frames (queue_slot_bytes) with the prompt
CACHE_ENTRIES = 64            # compiled grammars kept per process
# JSON without optional whitespace: a small model sampled at a high temperature can otherwise emit newlines
# and spaces until max_tokens (vLLM's --disable-any-whitespace, for the same reason).
JSON_OPTIONS = {"whitespace_flexible": False}
_CLOSING_BYTES = frozenset(b"]}")
_OPENING_BYTES = frozenset(b"[{")
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_QUOTE, _BACKSLASH = ord('"'), ord("\\")


def json_schema_grammar(schema: dict[str, Any] | None) -> str:
    """The llguidance grammar for JSON text valid under ``schema`` (None: any JSON object, for
    ``response_format: {"type": "json_object"}``). Compact JSON (no optional whitespace).

    Raises:
        InvalidRequestError: ``schema`` is not a JSON object (param ``response_format``). A schema with
            unsupported or contradictory keywords is caught by :meth:`GrammarCompiler.check`.
    """
    import llguidance

    if schema is None:
        schema = {"type": "object"}
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"the JSON schema is not usable: {exc}", param="response_format") from None


def lark_grammar(text: str) -> str:
    """The llguidance grammar of a Lark grammar text (llguidance's dialect: ``%json {schema}`` embeds a schema)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_lark(text)


AFTER_REASONING_SPACE = 2   # characters of whitespace between the reasoning's end and a constrained answer


def after_reasoning(answer: str, end: str, opened: bool, start: str = "", special: dict[str, int] | None = None,
                    ) -> str:
    """A Lark grammar (llguidance dialect) of the model's reasoning, free text up to ``end`` (``</think>``), then
    at most AFTER_REASONING_SPACE spaces or newlines (unbounded, a random-weight model wrote them to the end of
    ``max_tokens``), then ``answer`` (a Lark grammar whose ``start`` rule is the constrained answer; its other rules
    keep their names): vLLM's structured output after the reasoning ends (vllm-project/vllm issue 20663).
    ``opened``: the prompt ends inside the reasoning; else the answer opens it with ``start`` (``<think>``).
    ``special``: marker text -> token id for markers the tokenizer has as special tokens (matched as that token;
    a text marker ends the reasoning's lazy ``stop``). The budget that forces ``end`` is the matcher's
    (:meth:`GrammarCompiler.for_sampling`)."""
    special = special or {}
    body = re.sub(r"(?m)^start:", "pd_answer:", answer)

    def marker(text: str) -> str:
        return f"<[{special[text]}]>" if text in special else json.dumps(text)

    if end in special:   # a special token is never text: the free text ends where it comes
        reasoning = f"pd_reasoning {marker(end)}"
        rule = "pd_reasoning: /(.|\\n)*/"
    else:
        reasoning = "pd_reasoning"
        rule = f"pd_reasoning[stop={json.dumps(end)}]: /(.|\\n)*/"
    head = reasoning if opened else f"{marker(start)} {reasoning}"
    return f"start: {head} /[ \\n]{{0,{AFTER_REASONING_SPACE}}}/ pd_answer\n{rule}\n{body}"


def schema_lark(schema: dict[str, Any] | None) -> str:
    """A Lark grammar whose ``start`` is JSON valid under ``schema`` (None: any object), compact as
    :func:`json_schema_grammar`'s."""
    schema = dict(schema) if schema is not None else {"type": "object"}
    schema.setdefault("x-guidance", JSON_OPTIONS)
    return f"start: %json {json.dumps(schema)}\n"


class GrammarMatcher:
    """One request's grammar state: which tokens may come next, and the tokens accepted so far.

    Build with :meth:`GrammarCompiler.matcher`. Not thread-safe; one per sequence.
    """

    def __init__(self, matcher, compiler: "GrammarCompiler", reasoning_end: str = "", reasoning_budget: int = 0):
        self._m = matcher
        self._c = compiler
        self._words = compiler.mask_words
        self._in_string = False   # the output so far ends inside a JSON string (closing pressure)
        self._escape = False
        self._depth = 0           # brackets open outside strings
        self._number_chars = 0    # characters of the number the output ends in (0: it does not end in one)
        # a grammar after the reasoning (after_reasoning): no closing pressure nor number bound before its end
        self._end = reasoning_end.encode()
        self._budget = reasoning_budget
        self._reasoning_tokens = 0
        self._tail = b""          # the reasoning's last bytes, to see its end marker
        self._forced = compiler.forced_ids(reasoning_end) if reasoning_end and reasoning_budget else ()

    @property
    def reasoning(self) -> bool:
        """The output so far is still the reasoning before the grammar's answer."""
        return bool(self._end)

    def fill_bitmask(self, row: np.ndarray, tokens_left: int | None = None) -> None:
        """Write the allowed-token bitmask into ``row`` (``[mask_words]`` int32, bit ``t % 32`` of word
        ``t // 32`` set = token ``t`` allowed). Always allows at least one token: EOS once the matcher is stopped
        or in an error state."""
        if self._m.is_error():
            row[:] = 0
            self._c.set_eos_bits(row)
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._end:
            if self._forced and self._reasoning_tokens >= self._budget:   # the budget is spent: write the end
                token = self._forced[min(self._reasoning_tokens - self._budget, len(self._forced) - 1)]
                row[:] = 0
                row.view(np.uint32)[token // 32] |= np.uint32(1 << (token % 32))
            return
        if self._number_chars >= MAX_NUMBER_CHARS:
            ending = row & self._c.not_number_bits
            if ending.any():
                row[:] = ending
        if tokens_left is not None and tokens_left <= self.close_within():
            closing = row & (self._c.close_string_bits if self._in_string else self._c.close_bits)
            if not closing.any():
                closing = row & self._c.no_open_bits
            if closing.any():
                row[:] = closing
        if not row.any():   # nothing allowed (should not happen): end the sequence rather than sample garbage
            self._c.set_eos_bits(row)

    def close_within(self) -> int:
        """Closing pressure applies once at most this many tokens are left: CLOSE_WITHIN_TOKENS + open depth."""
        return CLOSE_WITHIN_TOKENS + self._depth

    def allowed_tokens(self, vocab_size: int, tokens_left: int | None = None) -> torch.Tensor:
        """``[vocab_size]`` bool, True = the token may be sampled next (tokens past the tokenizer's: False)."""
        return batch_allowed([self], vocab_size, [tokens_left])[0]

    def mask_logits(self, logits_row: torch.Tensor, tokens_left: int | None = None) -> torch.Tensor:
        """``logits_row`` ``[vocab]`` with the disallowed tokens at -inf (a new tensor)."""
        allowed = self.allowed_tokens(logits_row.shape[-1], tokens_left)
        return logits_row.masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> bool:
        """Advance past ``token``. Returns False (and the matcher turns to its error state, whose mask is EOS
        alone) when the grammar did not allow it."""
        if self._m.is_stopped():
            return token in self._c.eos_ids
        ok = self._m.consume_token(int(token))
        if not ok:
            log.warning("grammar rejected token %d: %s", token, self._m.get_error())
        raw = self._c.token_bytes[token] if 0 <= token < len(self._c.token_bytes) else b""
        if self._end:
            self._reasoning_tokens += 1
            self._tail = (self._tail + raw)[-len(self._end) - 16:]
            if self._end in self._tail:   # the answer starts: what follows the marker is the grammar's
                raw, self._end = self._tail.split(self._end, 1)[1], b""
            else:
                return ok
        self._scan(raw)
        return ok

    def _scan(self, raw: bytes) -> None:
        """Follow JSON string boundaries (quotes, backslash escapes), the open depth and the length of a number
        through the output's bytes."""
        for b in raw:
            if self._escape:
                self._escape = False
            elif self._in_string and b == _BACKSLASH:
                self._escape = True
            elif b == _QUOTE:
                self._in_string = not self._in_string
                self._number_chars = 0
            elif not self._in_string:
                if b in _OPENING_BYTES:
                    self._depth += 1
                elif b in _CLOSING_BYTES:
                    self._depth = max(0, self._depth - 1)
                self._number_chars = self._number_chars + 1 if b in _NUMBER_BYTES else 0

    def is_terminated(self) -> bool:
        """True when the grammar is complete and nothing but EOS can follow (or the matcher failed)."""
        return self._m.is_stopped()

    @property
    def error(self) -> str:
        return self._m.get_error()


class GrammarCompiler:
    """Per-process grammar compiler: the llguidance tokenizer view of the served model, and an LRU cache of
    compiled grammars.

    Args:
        model_path: GGUF file or HF directory of the served model ("" or None: the embedded default); its
            tokenizer is loaded on first use (0.5 s with the model cache's GGUF header, ~4 s without;
            llguidance's view of it ~0.3 s of that), or ahead of time by :meth:`warm_up` in a thread.
        tokenizer: an already loaded gpu.tokenizer.Tokenizer (the API process has one); replaces model_path.
        cache_dir: the model cache holding the GGUF header (``gpu.model_files.model_cache_dir``; None = read
            the model file) when the tokenizer is loaded from ``model_path``.
    """

    def __init__(self, model_path: str | None = None, tokenizer=None, cache_dir=None):
        self._model_path = model_path or None
        self._tokenizer = tokenizer
        self._cache_dir = cache_dir
        self._lock = threading.Lock()
        self._ll = None
        self._cache: collections.OrderedDict[str, Any] = collections.OrderedDict()

    # ---- the tokenizer view, loaded once ---------------------------------------------------------------
    def warm_up(self, background: bool = True) -> None:
        """Load the tokenizer view now (in a daemon thread when ``background``), so the first constrained
        request does not wait for it on the actor's loop."""
        if background:
            threading.Thread(target=self._load, name="grammar-warm-up", daemon=True).start()
        else:
            self._load()

    def _load(self):
        with self._lock:
            if self._ll is None:
                import llguidance

                from gpu.tokenizer import Tokenizer

                tok = self._tokenizer or Tokenizer.load(self._model_path, self._cache_dir)
                ll = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size,
                                            eos_token=list(tok.eos_token_ids))
                self.vocab_size = ll.vocab_size
                self.mask_words = (ll.vocab_size + 31) // 32
                self.eos_ids = frozenset(int(t) for t in ll.eos_tokens)
                self.token_bytes = [ll.decode_bytes([t]) for t in range(ll.vocab_size)]
                close = np.zeros(self.mask_words * 32, dtype=bool)       # ]}-only tokens and EOS
                close_string = np.zeros(self.mask_words * 32, dtype=bool)  # " then ]}-only
                no_open = np.zeros(self.mask_words * 32, dtype=bool)     # no [ or { (and EOS)
                not_number = np.zeros(self.mask_words * 32, dtype=bool)  # not starting with a number's byte
                for t, raw in enumerate(self.token_bytes):
                    if raw and _CLOSING_BYTES.issuperset(raw):
                        close[t] = True
                    elif raw[:1] == b'"' and _CLOSING_BYTES.issuperset(raw[1:]):
                        close_string[t] = True
                    no_open[t] = _OPENING_BYTES.isdisjoint(raw)
                    not_number[t] = not raw or raw[0] not in _NUMBER_BYTES
                close[list(self.eos_ids)] = True
                pack = lambda bits: np.packbits(bits, bitorder="little").view(np.int32).copy()   # noqa: E731
                self.close_bits, self.close_string_bits = pack(close), pack(close_string)
                self.no_open_bits, self.not_number_bits = pack(no_open), pack(not_number)
                self._ll = ll
            return self._ll

    def set_eos_bits(self, row: np.ndarray) -> None:
        words = row.view(np.uint32)
        for t in self.eos_ids:
            words[t // 32] |= np.uint32(1 << (t % 32))

    # ---- compiling -------------------------------------------------------------------------------------
    def _compiled(self, grammar: str):
        import llguidance

        ll = self._load()
        with self._lock:
            cached = self._cache.get(grammar)
            if cached is not None:
                self._cache.move_to_end(grammar)
                return cached
        matcher = llguidance.LLMatcher(ll, grammar, log_level=0)   # drops the GIL while it builds
        if matcher.is_error():
            raise InvalidRequestError(f"the grammar cannot be compiled: {matcher.get_error()}",
                                      param="response_format")
        with self._lock:
            self._cache[grammar] = matcher
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
        return matcher

    def check(self, grammar: str, param: str = "response_format") -> None:
        """Compile ``grammar`` (cached), so an unusable one is refused before admission.

        Raises:
            InvalidRequestError: the grammar is over MAX_GRAMMAR_BYTES or the library rejects it (``param``
                names the request field it came from).
        """
        if len(grammar) > MAX_GRAMMAR_BYTES:
            raise InvalidRequestError(f"the grammar made from '{param}' has {len(grammar)} bytes; the limit is "
                                      f"{MAX_GRAMMAR_BYTES}", param=param)
        try:
            self._compiled(grammar)
        except InvalidRequestError as exc:
            raise InvalidRequestError(f"'{param}' cannot be used for constrained decoding: {exc.message}",
                                      param=param) from None

    def matcher(self, grammar: str, tokens: Sequence[int] = (), reasoning_end: str = "",
                reasoning_budget: int = 0) -> GrammarMatcher:
        """A fresh matcher for ``grammar`` that has accepted ``tokens`` (the output so far: decode rebuilds the
        state prefill had after its first token this way). ``reasoning_end``, ``reasoning_budget``: the grammar
        starts after the model's reasoning (:func:`after_reasoning`), which ends with that text, forced once the
        reasoning has that many tokens (0: never forced).

        Never raises: the API checked the grammar on admission; should the library still reject it here, the
        matcher is in its error state, which allows EOS alone (the sequence ends at once), and a line is logged.
        """
        try:
            compiled = self._compiled(grammar).deep_copy()
        except InvalidRequestError as exc:
            import llguidance

            log.error("a request's grammar does not compile in this actor: %s", exc.message)
            compiled = llguidance.LLMatcher(self._load(), grammar, log_level=0)
        m = GrammarMatcher(compiled, self, reasoning_end, reasoning_budget)
        for token in tokens:
            m.accept(token)
        return m

    def for_sampling(self, sampling, tokens: Sequence[int] = ()) -> GrammarMatcher:
        """:meth:`matcher` for a request's pdserve.sampling.Sampling (its grammar, and the reasoning before it)."""
        return self.matcher(sampling.grammar, tokens, sampling.reasoning_end, sampling.reasoning_budget)

    def forced_ids(self, text: str) -> tuple[int, ...]:
        """The token ids that write ``text`` when it is forced (its own tokenization, from a token boundary)."""
        return tuple(int(t) for t in self._load().tokenize_str(text))


def batch_allowed(matchers: Sequence[GrammarMatcher | None], vocab_size: int,
                  tokens_left: Sequence[int | None] | None = None) -> torch.Tensor | None:
    """The allowed-token masks of a batch: ``[B, vocab_size]`` bool (rows without a matcher: all True), or None
    when no row has a matcher (the sampler then skips masking).

    Args:
        matchers: ``B`` matchers or None.
        vocab_size: the logits' last dimension (tokens past the tokenizer's vocabulary are never allowed).
        tokens_left: ``B`` remaining token budgets (max_tokens minus tokens generated), for closing pressure.
    """
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    first = matchers[rows[0]]
    words = first._words
    bits = np.full((len(matchers), words), -1, dtype=np.int32)   # all allowed
    for i in rows:
        matchers[i].fill_bitmask(bits[i], None if tokens_left is None else tokens_left[i])
    unpacked = np.unpackbits(bits.view(np.uint8), axis=1, bitorder="little").view(bool)  # [B, words * 32]
    import torch

    allowed = torch.from_numpy(unpacked)
    width = words * 32
    if vocab_size <= width:
        allowed = allowed[:, :vocab_size]
        for i in rows:   # bits past the tokenizer's vocabulary were not written by llguidance: clear them
            allowed[i, first._c.vocab_size:] = False
        return allowed
    out = torch.zeros((len(matchers), vocab_size), dtype=torch.bool)
    out[:, :width] = allowed
    unconstrained = [i for i, m in enumerate(matchers) if m is None]
    out[unconstrained] = True
    return out


def accept_tokens(matchers: Sequence[GrammarMatcher | None], tokens: Sequence[int]) -> None:
    """Advance each row's matcher past the token sampled for it (rows without a matcher are skipped)."""
    for m, t in zip(matchers, tokens):
        if m is not None:
            m.accept(int(t))
