"""Next-token sampling: penalties, greedy, temperature, top-k, top-p (nucleus), min-p, seeded per request;
and log-probabilities of chosen and prompt tokens.

Order follows vLLM's sampler and HF's logits processors/warpers: repetition, frequency and presence penalties
first (so they change greedy choices too), then OpenAI's ``logit_bias`` (added to the chosen ids' logits), then a
grammar's mask, temperature, top-k, top-p, min-p, then a multinomial draw
from the renormalised distribution. The repetition penalty is Keskar et al. 2019 ("CTRL"), as in HF's
``RepetitionPenaltyLogitsProcessor`` and vLLM's ``apply_penalties``; frequency and presence penalties are
OpenAI's documented formula (output tokens only). Top-p is Holtzman et al. 2020 ("The Curious Case of
Neural Text Degeneration"); min-p is Nguyen et al. 2024 ("Min P Sampling"): keep tokens whose probability
is at least ``min_p`` times the most likely token's.

Log-probabilities are computed from the raw model logits, before penalties and temperature (vLLM's default
``raw_logprobs`` mode; OpenAI's ``logprobs``/``top_logprobs``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.sampling import GREEDY_TEMPERATURE, MAX_LOGPROBS, Sampling

__all__ = ["Sampling", "Sampler", "make_generator", "apply_penalties", "TokenLogprob", "token_logprobs",
           "prompt_logprobs", "GREEDY_TEMPERATURE", "MAX_LOGPROBS"]

# One sequence's token history for penalties: (prompt_ids, output_ids), each a sequence of token ids
# (list, tuple, numpy array or 1-D integer tensor).
History = tuple[Sequence[int], Sequence[int]]


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A ``torch.Generator`` seeded with ``seed`` for one request, or None (draw from torch's global RNG)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed))
    return g


def _flat_ids(rows: list[int], seqs: list[Sequence[int]], vocab: int, what: str) -> torch.Tensor:
    """Indices ``row * vocab + id`` into a flattened ``[B, vocab]`` tensor, for each id of ``seqs[j]`` in ``rows[j]``.

    Raises:
        ValueError: an id is outside ``[0, vocab)``.
    """
    ids = [torch.as_tensor(q, dtype=torch.long).reshape(-1) for q in seqs]
    flat = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)  # [sum of lengths]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= vocab):
        raise ValueError(f"{what} has a token id outside the vocabulary [0, {vocab})")
    lengths = torch.tensor([t.numel() for t in ids], dtype=torch.long)  # [len(rows)]
    return torch.repeat_interleave(torch.tensor(rows, dtype=torch.long) * vocab, lengths) + flat


def apply_penalties(logits: torch.Tensor, params: Sequence[Sampling],
                    histories: Sequence[History | None] | None) -> torch.Tensor:
    """Logits with each row's repetition, frequency and presence penalties applied.

    Per penalised row, in this order (vLLM ``apply_penalties``; HF ``RepetitionPenaltyLogitsProcessor``):
    for every token id seen in the prompt or the output, ``logit / repetition_penalty`` if ``logit > 0`` else
    ``logit * repetition_penalty`` (CTRL, Keskar et al. 2019); then ``logit -= frequency_penalty * count`` and
    ``logit -= presence_penalty * (count > 0)``, where ``count`` is the token's number of occurrences in the
    output only (OpenAI's formula). Only the seen tokens are touched (one ``unique`` over the histories, then
    gather/scatter), so the cost is one copy of ``logits`` plus O(history length), not O(vocab) per penalty.

    Args:
        logits: ``[B, vocab]`` float32; not modified.
        params: ``B`` validated :class:`Sampling`.
        histories: None, or ``B`` items, each None or ``(prompt_ids, output_ids)``; needed for (only) the rows
            whose params have penalties.
    Returns:
        ``logits`` itself when no row has penalties, else a new ``[B, vocab]`` tensor whose unpenalised rows are
        bit-identical copies.
    Raises:
        ValueError: a row has penalties but no history, ``histories`` has the wrong length, or a history holds
            a token id outside ``[0, vocab)``.
    """
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    if histories is None:
        raise ValueError(f"rows {rows} have presence/frequency/repetition penalties, so sample() needs their "
                         "token histories: pass histories=[(prompt_ids, output_ids) or None, ...]")
    if len(histories) != len(params):
        raise ValueError(f"{len(histories)} histories for a batch of {len(params)}: pass one per row")
    missing = [i for i in rows if histories[i] is None]
    if missing:
        raise ValueError(f"rows {missing} have penalties but no history: pass (prompt_ids, output_ids) for them")
    vocab = logits.shape[-1]
    out = logits.clone(memory_format=torch.contiguous_format)  # out: [B, vocab], row-major for flat
    flat = out.view(-1)  # [B * vocab]
    output_idx = _flat_ids(rows, [histories[i][1] for i in rows], vocab, "output_ids")  # [output tokens]
    rep_rows = [i for i in rows if params[i].repetition_penalty != 1.0]
    if rep_rows:  # the prompt matters only to the repetition penalty
        prompt_idx = _flat_ids(rep_rows, [histories[i][0] for i in rep_rows], vocab, "prompt_ids")
        seen = torch.unique(torch.cat([prompt_idx, output_idx]))  # [distinct (row, id) pairs]
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=out.dtype)[seen // vocab]
        x = flat[seen]
        flat[seen] = torch.where(x > 0, x / rep, x * rep)
    if output_idx.numel():
        tokens, counts = torch.unique(output_idx, return_counts=True)  # [distinct (row, id) pairs]
        row_of = tokens // vocab
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=out.dtype)[row_of]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=out.dtype)[row_of]
        flat[tokens] = flat[tokens] - freq * counts.to(out.dtype) - pres
    return out


def apply_logit_bias(logits: torch.Tensor, params: Sequence[Sampling]) -> torch.Tensor:
    """``logits`` (``[B, vocab]`` float32, not modified) with each row's ``logit_bias`` added; ``logits`` itself
    when no row has one, else a new tensor (unbiased rows bit-identical copies)."""
    rows = [i for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    out = logits.clone()
    for i in rows:
        ids = torch.tensor([t for t, _ in params[i].logit_bias], dtype=torch.long, device=out.device)
        bias = torch.tensor([b for _, b in params[i].logit_bias], dtype=out.dtype, device=out.device)
        out[i].index_add_(0, ids, bias)
    return out


class Sampler:
    """Picks one token per row of a logits batch; stateless (randomness lives in per-request generators)."""

    def sample(self, logits: torch.Tensor, params: list[Sampling],
               generators: list[torch.Generator | None],
               histories: Sequence[History | None] | None = None,
               allowed: torch.Tensor | None = None) -> list[int]:
        """Sample the next token of each sequence.

        Args:
            logits: ``[B, vocab]`` (any float dtype; computed in float32); not modified.
            params: ``B`` validated :class:`Sampling`.
            generators: ``B`` generators from :func:`make_generator` (None = global RNG); used only for
                non-greedy rows, one draw per row per call, so a seeded request is reproducible regardless
                of what it is batched with.
            histories: None, or ``B`` items, each None or ``(prompt_ids, output_ids)`` (sequences of token
                ids). Required for rows whose params have penalties; those are applied (see
                :func:`apply_penalties`) before greedy argmax and temperature, so they change greedy choices;
                each row's ``logit_bias`` is added next (:func:`apply_logit_bias`).
            allowed: None, or ``[B, vocab]`` bool: only tokens marked True may be chosen (a grammar's mask, see
                gpu.grammar.batch_allowed); applied after penalties, before greedy argmax and temperature.
        Returns:
            ``B`` token ids.
        Raises:
            ValueError: the lengths of ``logits``, ``params`` and ``generators`` disagree, a row with
                penalties has no history (see :func:`apply_penalties`), or ``allowed`` has the wrong shape or
                a row with no allowed token.
        """
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"logits {list(logits.shape)}, {len(params)} params and {len(generators)} "
                             "generators must describe the same batch")
        if allowed is not None and (allowed.shape != logits.shape or allowed.dtype != torch.bool):
            raise ValueError(f"allowed must be a bool tensor shaped like logits {list(logits.shape)}, got "
                             f"{allowed.dtype} {list(allowed.shape)}")
        with torch.inference_mode():
            logits = apply_logit_bias(apply_penalties(logits.float(), params, histories), params)
            if allowed is not None:
                if not bool(allowed.any(dim=-1).all()):
                    raise ValueError("allowed has a row with no allowed token")
                logits = logits.masked_fill(~allowed, float("-inf"))
            out = logits.argmax(dim=-1).tolist()  # greedy answer for every row; replaced for sampled rows
            for i, p in enumerate(params):
                if not p.greedy:
                    out[i] = self._sample_row(logits[i], p, generators[i])
            return out

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: Sampling, gen: torch.Generator | None) -> int:
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


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """One position's log-probabilities (natural log, from the raw logits in float32).

    token_id: the chosen (or prompt) token. logprob: its log-probability. top: the ``top_n`` most likely
    tokens as ``(token_id, logprob)``, by logprob descending, ties broken by lower id first.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int] | torch.Tensor,
                   top_n: Sequence[int | None]) -> list[TokenLogprob | None]:
    """Log-probability of each row's chosen token and its ``top_n`` most likely alternatives.

    ``logits`` are the RAW model logits, before penalties, temperature and top-k/top-p/min-p: vLLM's default
    ``raw_logprobs`` mode, so a greedy and a sampled request report the same numbers for the same model output.
    One ``log_softmax`` over the rows that want log-probabilities and one ``topk`` (k = the largest ``top_n``).

    Args:
        logits: ``[B, vocab]`` raw logits (any float dtype; computed in float32).
        token_ids: ``B`` chosen token ids.
        top_n: ``B`` items: None = no log-probabilities for that row, else the number of alternatives (>= 0;
            more than ``vocab`` is clamped to ``vocab``).
    Returns:
        ``B`` items: None where ``top_n`` is None, else a :class:`TokenLogprob`.
    Raises:
        ValueError: lengths disagree, a ``top_n`` is negative, or a token id is outside ``[0, vocab)``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(token_ids) or len(token_ids) != len(top_n):
        raise ValueError(f"logits {list(logits.shape)}, {len(token_ids)} token_ids and {len(top_n)} top_n "
                         "must describe the same batch")
    result: list[TokenLogprob | None] = [None] * len(top_n)
    rows = [i for i, n in enumerate(top_n) if n is not None]
    if not rows:
        return result
    vocab = logits.shape[-1]
    if any(top_n[i] < 0 for i in rows):
        raise ValueError(f"top_n must be None or >= 0, got {list(top_n)}")
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(-1)  # [B]
    with torch.inference_mode():
        if len(rows) < len(top_n):
            row_index = torch.tensor(rows, dtype=torch.long)  # [R]
            x, ids = logits.index_select(0, row_index), ids.index_select(0, row_index)
        else:
            x = logits
        ids_list = ids.tolist()
        if any(t < 0 or t >= vocab for t in ids_list):
            raise ValueError(f"token_ids has an id outside the vocabulary [0, {vocab})")
        lp = torch.log_softmax(x.float(), dim=-1)  # lp: [R, vocab]
        chosen = lp.gather(1, ids[:, None]).squeeze(1).tolist()  # [R]
        k = min(max(top_n[i] for i in rows), vocab)
        tops: list[list[tuple[int, float]]] = [[] for _ in rows]
        if k > 0:
            # One extra value shows whether tokens tied with the k-th may have been left out: topk's choice
            # among equal values is unspecified, and ties must go to the lower id. Redo those (rare) rows exactly.
            values, indices = torch.topk(lp, min(k + 1, vocab), dim=-1)  # [R, k or k + 1]
            values_list, indices_list = values[:, :k].tolist(), indices[:, :k].tolist()
            if k < vocab:
                for r in (values[:, k] == values[:, k - 1]).nonzero().flatten().tolist():
                    kth = values[r, k - 1]
                    above = (lp[r] > kth).nonzero().flatten()
                    tied = (lp[r] == kth).nonzero().flatten()[: k - above.numel()]  # ascending ids
                    pick = torch.cat([above, tied])
                    indices_list[r], values_list[r] = pick.tolist(), lp[r, pick].tolist()
            for r in range(len(rows)):
                tops[r] = sorted(zip(indices_list[r], values_list[r]), key=lambda p: (-p[1], p[0]))
        for r, i in enumerate(rows):
            result[i] = TokenLogprob(token_id=ids_list[r], logprob=chosen[r], top=tuple(tops[r][: top_n[i]]))
    return result


def prompt_logprobs(logits: torch.Tensor, prompt_ids: Sequence[int] | torch.Tensor,
                    top_n: int) -> list[TokenLogprob | None]:
    """Log-probabilities of the prompt's own tokens (for ``echo``), from the raw logits at every position.

    Position ``i`` >= 1 scores ``prompt_ids[i]`` with ``logits[i - 1]`` (the prediction made after reading
    token ``i - 1``); position 0 has nothing before it and gets None (as in OpenAI's echo and vLLM's
    prompt_logprobs). ``logits[T - 1]`` predicts the first generated token and is not used here.
    Computed like :func:`token_logprobs` (raw logits, float32, one log_softmax and one topk).

    Args:
        logits: ``[T, vocab]`` raw logits at every prompt position.
        prompt_ids: ``T`` prompt token ids.
        top_n: number of alternatives per position (>= 0).
    Returns:
        ``T`` items: None at position 0, then a :class:`TokenLogprob` per position.
    Raises:
        ValueError: ``logits`` does not have ``T`` rows, ``top_n`` is negative, or an id is outside the vocab.
    """
    n_tokens = len(prompt_ids)
    if logits.dim() != 2 or logits.shape[0] != n_tokens:
        raise ValueError(f"logits {list(logits.shape)} must have one row per prompt token ({n_tokens})")
    if n_tokens == 0:
        return []
    ids = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)  # [T]
    rest = token_logprobs(logits[:-1], ids[1:], [top_n] * (n_tokens - 1))
    return [None] + rest
