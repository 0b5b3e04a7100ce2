"""The one sampling type, from the HTTP body to the actors' sampler.

=======================  =========================================================================
``Sampling``             a request's sampling settings (frozen; positional on the wire), ``validate``
constants                GREEDY_TEMPERATURE and the ranges ``validate`` checks
=======================  =========================================================================

Plain data, no torch: the API process builds it, the actors read it (gpu/sampling.py samples with it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (argmax)
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # most top alternatives per token (OpenAI's top_logprobs limit)
MAX_PRESENCE_FREQUENCY_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 10.0  # repetition_penalty lies in (0, 10]
MAX_LOGIT_BIAS = 100.0  # logit_bias values lie in [-100, 100] (OpenAI)


@dataclass(frozen=True)
class Sampling:
    """How to pick tokens for one request: built once by the API's parser (api/protocol.py), sent on the wire
    (actors/messages.py), read by the actors' sampler (gpu/sampling.py).

    temperature: >= 0; below GREEDY_TEMPERATURE means greedy. top_p: in (0, 1]. top_k: -1 (or 0) = off, else >= 1.
    min_p: in [0, 1]. seed: None or an int in [0, 2**63 - 1]; the same seed gives the same tokens. max_tokens:
    >= 1 new tokens, resolved by the parser (the body's, or the room the prompt leaves, under
    ``max_tokens_policy``). stop_token_ids: ids that end generation (besides EOS). ignore_eos: keep going past the
    model's EOS tokens. presence_penalty, frequency_penalty: in [-2, 2], OpenAI's (output tokens only).
    repetition_penalty: in (0, 10]; 1 = off (CTRL, Keskar et al. 2019). logprobs: None = none, else the chosen
    token's log-probability and its ``logprobs`` (0..20) most likely alternatives. Fields are positional on the
    wire: new ones go at the end.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None   # None: none; k: the chosen token's log-probability and the top k alternatives
    prompt_logprobs: int | None = None   # completions' echo with logprobs: the same for every prompt token
    # structured output / forced tool call: the llguidance grammar (gpu.grammar) every sampled token must follow;
    # prefill masks the first token with it, decode rebuilds the matcher from it and the tokens so far
    grammar: str | None = None
    # output tokens decode reserves KV blocks for when it takes the request (0 = all of max_tokens); with fewer (a
    # request without max_tokens) decode takes one more block whenever the answer needs it and ends the answer
    # with finish_reason "length" when its pool has none free (actors/decode_core.py)
    reserve_tokens: int = 0
    # OpenAI's logit_bias as two parallel tuples: each bias (in [-100, 100]) is added to its token id's logit
    logit_bias_ids: tuple[int, ...] = ()
    logit_bias_values: tuple[float, ...] = ()
    # a grammar that starts after the model's reasoning (gpu.grammar.after_reasoning): the text that ends the
    # reasoning ("</think>"), and the most tokens the reasoning may take before that text is forced (0: no bound)
    reasoning_end: str = ""
    reasoning_budget: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when any of presence, frequency or repetition penalty changes the logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def logit_bias(self) -> tuple[tuple[int, float], ...]:
        """OpenAI's ``logit_bias`` as ``((token_id, bias), ...)``."""
        return tuple(zip(self.logit_bias_ids, self.logit_bias_values))

    @property
    def reserved_output_tokens(self) -> int:
        """Output tokens whose KV blocks are reserved up front (prompt + this is what decode reserves)."""
        return self.max_tokens if self.reserve_tokens <= 0 else min(self.reserve_tokens, self.max_tokens)

    def validate(self, vocab_size: int | None = None) -> "Sampling":
        """Check every field; returns ``self`` so it can be chained.

        Raises:
            InvalidRequestError: with ``param`` naming the first field out of range or of the wrong type.
        """
        def num(name: str, v: object) -> float:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise InvalidRequestError(f"{name} must be a finite number, got {v!r}", param=name)
            return float(v)

        def integer(name: str, v: object) -> int:
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequestError(f"{name} must be an integer, got {v!r}", param=name)
            return v

        if num("temperature", self.temperature) < 0:
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature}",
                                      param="temperature")
        if not 0 < num("top_p", self.top_p) <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", param="top_p")
        if integer("top_k", self.top_k) < -1:
            raise InvalidRequestError(f"top_k must be -1 or 0 (off) or >= 1, got {self.top_k}", param="top_k")
        if not 0 <= num("min_p", self.min_p) <= 1:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", param="min_p")
        if self.seed is not None and not 0 <= integer("seed", self.seed) <= MAX_SEED:
            raise InvalidRequestError(f"seed must be in [0, 2**63 - 1], got {self.seed}", param="seed")
        if integer("max_tokens", self.max_tokens) < 1:
            raise InvalidRequestError(f"max_tokens must be >= 1, got {self.max_tokens}", param="max_tokens")
        if not isinstance(self.stop_token_ids, tuple):
            raise InvalidRequestError("stop_token_ids must be a tuple of token ids", param="stop_token_ids")
        for t in self.stop_token_ids:
            integer("stop_token_ids", t)
            if t < 0 or (vocab_size is not None and t >= vocab_size):
                raise InvalidRequestError(
                    f"stop_token_ids has {t}, outside the vocabulary [0, {vocab_size or 'vocab_size'})",
                    param="stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}",
                                      param="ignore_eos")
        limit = MAX_PRESENCE_FREQUENCY_PENALTY
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -limit <= num(name, v) <= limit:
                raise InvalidRequestError(f"{name} must be in [-{limit:g}, {limit:g}], got {v}", param=name)
        if not 0 < num("repetition_penalty", self.repetition_penalty) <= MAX_REPETITION_PENALTY:
            raise InvalidRequestError(f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] "
                                      f"(1 = off), got {self.repetition_penalty}", param="repetition_penalty")
        if self.logprobs is not None and not 0 <= integer("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], "
                                      f"got {self.logprobs}", param="logprobs")
        if len(self.logit_bias_ids) != len(self.logit_bias_values):
            raise InvalidRequestError("logit_bias needs one bias per token id", param="logit_bias")
        for pair in self.logit_bias:
            if integer("logit_bias", pair[0]) < 0 or \
                    (vocab_size is not None and pair[0] >= vocab_size) or \
                    not -MAX_LOGIT_BIAS <= num("logit_bias", pair[1]) <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(f"logit_bias entries are (token id in the vocabulary, bias in "
                                          f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]), got {pair!r}",
                                          param="logit_bias")
        return self
