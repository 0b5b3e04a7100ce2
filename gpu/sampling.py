"""Next-token sampling: greedy, temperature, top-k, top-p (nucleus), min-p, seeded per request.

Order of the filters follows vLLM's sampler and HF's logits warpers: temperature, then top-k, then top-p,
then min-p, then a multinomial draw from the renormalised distribution. Top-p is Holtzman et al. 2020
("The Curious Case of Neural Text Degeneration"); min-p is Nguyen et al. 2024 ("Min P Sampling"): keep
tokens whose probability is at least ``min_p`` times the most likely token's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.errors import InvalidRequestError

__all__ = ["SamplingParams", "Sampler", "make_generator", "GREEDY_TEMPERATURE"]

GREEDY_TEMPERATURE = 1e-5  # temperatures below this are greedy (argmax)
MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature: >= 0; below 1e-5 means greedy. top_p: in (0, 1]. top_k: -1 (or 0) = off, else >= 1.
    min_p: in [0, 1]. seed: None or an int in [0, 2**63 - 1]; the same seed gives the same tokens.
    max_tokens: >= 1 new tokens. stop_token_ids: ids that end generation (besides EOS). ignore_eos: keep
    going past the model's EOS tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
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
        return self


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A ``torch.Generator`` seeded with ``seed`` for one request, or None (draw from torch's global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


class Sampler:
    """Picks one token per row of a logits batch; stateless (randomness lives in per-request generators)."""

    def sample(self, logits: torch.Tensor, params: list[SamplingParams],
               generators: list[torch.Generator | None]) -> list[int]:
        """Sample the next token of each sequence.

        Args:
            logits: ``[B, vocab]`` (any float dtype; computed in float32).
            params: ``B`` validated :class:`SamplingParams`.
            generators: ``B`` generators from :func:`make_generator` (None = global RNG); used only for
                non-greedy rows, one draw per row per call, so a seeded request is reproducible regardless
                of what it is batched with.
        Returns:
            ``B`` token ids.
        Raises:
            ValueError: the lengths of ``logits``, ``params`` and ``generators`` disagree.
        """
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"logits {list(logits.shape)}, {len(params)} params and {len(generators)} "
                             "generators must describe the same batch")
        with torch.inference_mode():
            logits = logits.float()
            out = logits.argmax(dim=-1).tolist()  # greedy answer for every row; replaced for sampled rows
            for i, p in enumerate(params):
                if not p.greedy:
                    out[i] = self._sample_row(logits[i], p, generators[i])
            return out

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
        # logits: [vocab] float32
        x = logits / p.temperature
        vocab = x.shape[0]
        if 0 < p.top_k < vocab:
            kth = torch.topk(x, p.top_k).values[-1]
            x = x.masked_fill(x < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_x, order = torch.sort(x, descending=True)  # [vocab]
            probs_sorted = sorted_x.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
            above = probs_sorted.cumsum(dim=-1) - probs_sorted  # [vocab] mass strictly above each token
            drop_sorted = above >= p.top_p
            drop_sorted[0] = False
            x = x.masked_fill(torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted), float("-inf"))
        probs = x.softmax(dim=-1)  # [vocab]
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=gen).item())
