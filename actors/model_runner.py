"""The model side of the actor shells: prefill forward passes in chunks, first-token sampling, decode steps and
log-probabilities on the wire. Used by actors/prefill.py and actors/decode.py (which also prefills in colocated
mode); the scheduling decisions stay in the cores.
"""
from __future__ import annotations

import logging
import time
from typing import Callable

from actors.messages import PromptLogprobs
from actors.shell import prefills_low_bit
from actors.topology import API

log = logging.getLogger("pdserve.actors")

# most prompts' last tokens in one decode step of PrefillRunner: under the native model's head_dense_min_rows, so
# each row's logits come from the batch-invariant low-bit output projection
LAST_TOKEN_ROWS = 16


def logprobs_to_wire(lp) -> list | None:
    """gpu.sampling.TokenLogprob -> ``[logprob, [[token_id, logprob], ...]]`` (None stays None)."""
    if lp is None:
        return None
    return [float(lp.logprob), [[int(t), float(v)] for t, v in lp.top]]


def _prompt_logprobs_of_chunk(before, chunk_logits, chunk: list[int], top_n: int) -> list:
    """Wire log-probabilities of ``chunk``'s tokens: token ``i`` is scored by the logits of the position before
    it (``before``, the previous chunk's last logits ``[vocab]``, for the chunk's first token; None = the
    prompt's first token, which has no score)."""
    import torch

    from gpu.sampling import token_logprobs

    entries = [] if before is not None else [None]
    rows = chunk_logits[:-1] if before is None else torch.cat([before[None, :], chunk_logits[:-1]])
    targets = chunk[1:] if before is None else chunk
    if targets:
        entries.extend(logprobs_to_wire(lp) for lp in token_logprobs(rows, targets, [top_n] * len(targets)))
    return entries


def send_prompt_logprobs(outbox, slot: int, generation: int, entries: list, top_n: int) -> None:
    """Send a prompt's log-probabilities to the API as PromptLogprobs frames of at most ~48 KiB each."""
    per_frame = max(1, 49152 // (32 * (top_n + 1) + 24))
    for start in range(0, len(entries), per_frame):
        outbox.send(API, PromptLogprobs(slot, generation, start, entries[start:start + per_frame]))


def first_tokens(sampler, logits, prompt_ids: list[int], samplings: list,
                 grammars=None) -> list[tuple[int, list | None]]:
    """Sample each row's first token from the prompt's last logits ``[vocab]``; a row whose sampling has a
    ``grammar`` samples among the tokens it allows (``grammars``: the actor's gpu.grammar.GrammarCompiler).

    Returns ``(token_id, logprobs or None)`` per entry of ``samplings``; logprobs on the wire form
    ``[logprob, [[token_id, logprob], ...]]`` (raw model log-probabilities, before penalties, temperature and
    the grammar's mask).
    """
    from gpu.grammar import batch_allowed
    from gpu.sampling import make_generator, token_logprobs

    params = list(samplings)
    batch = logits[None, :].expand(len(params), -1)
    histories = [(prompt_ids, ()) if p.has_penalties else None for p in params]
    matchers = [grammars.for_sampling(s) if s.grammar else None for s in samplings]
    allowed = batch_allowed(matchers, batch.shape[-1], [s.max_tokens for s in samplings])
    tokens = sampler.sample(batch, params, [make_generator(p.seed) for p in params], histories, allowed)
    return [(int(t), logprobs_to_wire(lp))
            for t, lp in zip(tokens, token_logprobs(batch, tokens, [p.logprobs for p in params]))]


def prefill_forward(model, kv, chunks: list[tuple], threads: int = 0) -> list[tuple]:
    """One forward pass over prompt chunks ``(prompt_ids, start, end, blocks, echo[, hidden])``: tokens
    ``start:end`` of each prompt into its ``blocks`` of the pool ``kv``, packed (``model.prefill_packed``);
    ``echo``: every position's logits are wanted (prompt log-probabilities); ``hidden`` (an embedding's chunk):
    every position's final hidden state after the final norm ``[end - start, hidden_size]`` instead of logits,
    every token through the packed prefill (none as a decode step). ``threads`` > 0: a native model's float32 GEMMs run
    on that many torch threads (``prefill_packed``'s ``gemm_threads``: fixed blocks of rows, the bits of one
    thread); every other op, and other models, keep torch's count.

    With a model whose ``prompt_last_by_decode`` is set (native weights), a chunk that ends its prompt runs its
    last token as a decode step (``model.decode``, the batch-invariant low-bit GEMVs, in steps of
    at most ``LAST_TOKEN_ROWS`` rows) after the packed prefill of its other tokens: a prompt whose prefix is cached
    then computes no float32 prefill block at all, and the token's logits are the same whether the prompt was
    cached, chunked, packed with others or echoed (an echoing chunk's last row of logits is the decode step's).

    Returns per chunk ``(logits, by_decode)``: ``[end - start, vocab]`` float32 with ``echo``, else the last
    token's ``[vocab]`` where the chunk ends its prompt, else None; ``by_decode``: its last token ran as a decode
    step (a longer prompt's prefill would compute that token's KV otherwise: the caller keeps it out of the prefix
    cache).
    """
    import torch

    if not chunks:
        return []
    ids, starts, ends, blocks, echoes = zip(*[c[:5] for c in chunks])
    hiddens = [len(c) > 5 and bool(c[5]) for c in chunks]
    split = getattr(model, "prompt_last_by_decode", False)
    by_decode = [split and end == len(p) and not h for p, end, h in zip(ids, ends, hiddens)]
    out: list = [None] * len(chunks)
    packed = [i for i in range(len(chunks)) if ends[i] - starts[i] > by_decode[i]]   # tokens left to prefill
    if packed:
        extra = {"gemm_threads": threads} if threads > 0 and getattr(model, "native", False) else {}
        if any(hiddens):
            extra["hidden"] = [hiddens[i] for i in packed]
        logits = model.prefill_packed(kv, [ids[i][starts[i]:ends[i] - by_decode[i]] for i in packed],
                                      [blocks[i] for i in packed], [starts[i] for i in packed],
                                      [echoes[i] for i in packed],
                                      [ends[i] == len(ids[i]) and not by_decode[i] for i in packed], **extra)
        for i, chunk_logits in zip(packed, logits):
            out[i] = chunk_logits
    finals = [i for i, d in enumerate(by_decode) if d]
    for at in range(0, len(finals), LAST_TOKEN_ROWS):
        group = finals[at:at + LAST_TOKEN_ROWS]
        rows = model.decode(kv, [ids[i][ends[i] - 1] for i in group], [ends[i] - 1 for i in group],
                            [blocks[i] for i in group])   # [B, vocab]
        for i, row in zip(group, rows):
            out[i] = row if not echoes[i] else row[None] if out[i] is None else torch.cat([out[i], row[None]])
    return list(zip(out, by_decode))


POOLINGS = ("last", "mean")   # how an embedding pools its tokens' final hidden states (config ``pooling``)


def pooled_embedding(rows, pooling: str):
    """An embedding from a prompt's final hidden states after the final norm, ``rows`` ``[T, hidden_size]``
    float32 (every token for ``"mean"``; at least the last one for ``"last"``): the last row (``"last"``: the
    token that has read the whole input under causal attention, vLLM's default for a decoder's embeddings) or the
    mean over the rows (``"mean"``), then divided by its L2 norm (both servers normalise). Returns ``[hidden_size]``
    float32. Raises ValueError for another ``pooling``."""
    import torch.nn.functional as F

    if pooling == "last":
        vector = rows[-1]
    elif pooling == "mean":
        vector = rows.mean(dim=0)
    else:
        raise ValueError(f"pooling {pooling!r}: must be one of {', '.join(POOLINGS)}")
    return F.normalize(vector.float(), dim=0)


def embedding_to_wire(vector) -> str:
    """``[hidden_size]`` float32 -> base64 of its little-endian float32 bytes (actors.messages.Embedding.data)."""
    import base64

    import numpy as np

    return base64.b64encode(vector.detach().cpu().numpy().astype("<f4").tobytes()).decode("ascii")


class PrefillRunner:
    """Runs the forward passes a PrefillCore plans (actors/prefill_core.py): one packed forward per batch of
    chunks (``LlamaModel.prefill_packed``), the prompt log-probabilities of requests that echo them, and the
    first token of each prompt completed, sampled with its own settings (seed, grammar, logprobs).

    ``grammars``: the actor's gpu.grammar.GrammarCompiler (requests with a grammar need one).
    """

    def __init__(self, model, kv, sampler, outbox, grammars=None):
        self.model, self.kv, self.sampler, self.outbox, self.grammars = model, kv, sampler, outbox, grammars
        self.threads = 0   # the next pass's torch threads (native models; the actor sets it per pass; 0: as set)
        # per request echoing its prompt's log-probabilities: (wire entries so far, last chunk's last logits)
        self.echo: dict[tuple[int, int], tuple[list, object]] = {}
        # per embedding being prefilled: the final hidden states of its chunks so far ([T_chunk, hidden_size] each)
        self.hidden: dict[tuple[int, int], list] = {}

    def run(self, core, chunks, after_forward: Callable[[list], None] = lambda chunks: None) -> None:
        """One forward pass over ``chunks`` (from ``core.next_batch()``, through :func:`prefill_forward`), then
        ``after_forward(chunks)`` (the shell's per-chunk fault hooks), then ``core.batch_done`` and ``core.finish``
        for each completed prompt (an embedding: ``core.finish_embedding`` with its :func:`pooled_embedding`, from
        its rows' final hidden states kept chunk by chunk and pooled once whole, so its numbers do not depend on how
        the batcher cut or packed it). A prompt whose last token ran as a decode step keeps that token's KV out of
        the prefix cache (its work's ``cache_tokens``)."""
        import torch

        embeds = [c.work.embedding for c in chunks]
        echoes = [not e and c.work.request.sampling.prompt_logprobs is not None for c, e in zip(chunks, embeds)]
        # an embedding wants hidden states of every chunk when it averages them, of its last one otherwise
        hiddens = [e and (c.last or c.work.request.pooling == "mean") for c, e in zip(chunks, embeds)]
        outs = prefill_forward(self.model, self.kv, [(c.work.request.prompt_ids, c.start, c.end, c.work.blocks, e, h)
                                                     for c, e, h in zip(chunks, echoes, hiddens)], self.threads)
        lasts = {}
        for chunk, echo, embed, (chunk_logits, by_decode) in zip(chunks, echoes, embeds, outs):
            key = (chunk.work.request.slot, chunk.work.request.generation)
            if embed:
                if chunk_logits is not None:
                    self.hidden.setdefault(key, []).append(chunk_logits)
                continue
            if by_decode:
                chunk.work.cache_tokens = chunk.end - 1
            if echo:
                entries, before = self.echo.get(key, ([], None))
                top_n = chunk.work.request.sampling.prompt_logprobs
                entries.extend(_prompt_logprobs_of_chunk(before, chunk_logits,
                                                         chunk.work.request.prompt_ids[chunk.start:chunk.end], top_n))
                self.echo[key] = (entries, chunk_logits[-1])
                chunk_logits = chunk_logits[-1]
            lasts[key] = chunk_logits
        after_forward(chunks)
        for work in core.batch_done(chunks):
            key = (work.request.slot, work.request.generation)
            if work.embedding:
                rows = self.hidden.pop(key)
                core.finish_embedding(work, embedding_to_wire(pooled_embedding(
                    rows[0] if len(rows) == 1 else torch.cat(rows), work.request.pooling)))
                continue
            firsts = first_tokens(self.sampler, lasts[key], work.request.prompt_ids, work.samplings, self.grammars)
            if key in self.echo:   # to the first live row's handle; the API shares them among the choices
                send_prompt_logprobs(self.outbox, *work.rows[0][1], self.echo.pop(key)[0],
                                     work.request.sampling.prompt_logprobs)
            core.finish(work, firsts)
        live = {(w.request.slot, w.request.generation) for w in core.prefilling}
        for held in (self.echo, self.hidden):
            for key in [k for k in held if k not in live]:   # aborted meanwhile
                del held[key]


def copy_block_rows(kv, src_block: int, dst_block: int, rows: int) -> None:
    """``kv[:, :, dst_block, :rows] = kv[:, :, src_block, :rows]``: the first ``rows`` token rows of one block,
    every layer, K and V, into another block of the same pool (``kv``: the pool tensor ``[num_layers, 2,
    num_blocks, block_tokens, num_kv_heads, head_dim]``, on any device). The prefix cache's copy-on-write of a hit
    ending mid-block (actors/prefix_cache.py ``copy_rows``): one strided copy of a part of one block, where the
    transports' whole-block copies (ipc/kv_copy.py, gpu/kernels/kv_copy.py) move many blocks between two pools."""
    kv[:, :, dst_block, :rows].copy_(kv[:, :, src_block, :rows])


def warm_up(model, pool, kv=None, decode: bool = True, threads: int = 1, prefill_threads: int = 1,
            prefill: bool = True) -> None:
    """One tiny prefill (and with ``decode``, one decode step) into a borrowed block, before the actor reports
    READY: the first real request then pays no lazy initialization (kernel selection, allocations, numba's
    compilation or cache load) that could starve the heartbeat. The caller resets the pool afterwards. An actor
    that never decodes passes ``decode=False``: with native weights a decode step also gathers the layers' tiles
    (``LlamaModel._stack_layers``: views, the norms stacked) and loads the decode kernels. One that never prefills (a decode
    actor that is not colocated) passes ``prefill=False``: its decode step reads the block's zeroed rows, and it
    neither loads the prefill kernels nor pages in the weights' float32 copies (~0.9 s of CPU at start-up).
    ``threads`` > 1 (a native decode actor's most, ``actors.shell.decode_threads``): the step runs again on that
    many threads, which loads the threaded kernels. ``prefill_threads`` > 1 (a native prefill actor's most,
    ``actors.shell.prefill_threads``): the prefill runs again on that many GEMM threads, which finds their plans
    (``gpu.model.gemm_plan``)."""
    started = time.monotonic()
    if decode and getattr(model, "native", False):
        log.info("warming up the low-bit decode kernels (compiled once per checkout into gpu/__pycache__: "
                 "15-60 s the first time)")
    blocks = pool.allocate(1, 0)
    kv = pool.tensor() if kv is None else kv   # the pool's data, or its actor's device tensor (actors.shell.pool_tensor)
    # no logits: the engine's prompts take theirs from decode steps, and planning the output projection's GEMM
    # (only echoes run it) would cost a native model ~0.5 s here
    if prefill:
        model.prefill_packed(kv, [[1, 2, 3]], [blocks], [0], logits=[False])
    if prefill and prefill_threads > 1 and getattr(model, "native", False):
        model.prefill_packed(kv, [[1, 2, 3]], [blocks], [0], logits=[False], gemm_threads=prefill_threads)
    if decode:
        model.decode(kv, [4], [3], [blocks])
    threaded = False
    if decode and threads > 1 and getattr(model, "native", False):
        from gpu.lowbit_cpu import set_threads

        threads = set_threads(threads)
        threaded = threads > 1
        model.decode(kv, [4], [3], [blocks])
        set_threads(1)
    pool.free(blocks, 0)
    # the fused low-bit decode step ran iff the model stacked its Q4 layers for it (tests read this line)
    path = "lowbit_cpu.decode_layers" if decode and getattr(model, "_stacked", None) else "per-layer"
    kind = "low-bit" if prefills_low_bit(model) else "dense"
    log.info("warm-up done in %.1f s (decode steps: %s%s; prefill: %s%s)", time.monotonic() - started,
             path if decode else "none", f" on up to {threads} threads" if threaded else "", kind,
             "" if prefill else " (not run: this actor never prefills)")


class DecodeRunner:
    """One batched decode step over a DecodeCore's running batch: forward, penalties, grammar masks, sampling,
    logprobs. ``grammars``: the actor's gpu.grammar.GrammarCompiler (requests with a grammar need one)."""

    def __init__(self, model, kv, sampler, grammars=None):
        self.model, self.kv, self.sampler, self.grammars = model, kv, sampler, grammars
        self.threads = 1   # the next step's low-bit GEMV threads (native models; the actor sets it per step)

    def prepare(self, entry) -> None:
        """A request joined the batch: its Sampling, seeded generator (prefill used ``seed``) and grammar
        matcher, rebuilt from the grammar and the first token prefill sampled under it."""
        from gpu.sampling import make_generator

        sampling = entry.ready.sampling
        params = sampling
        generator = make_generator((params.seed + 1) % 2**63) if params.seed is not None else None
        matcher = self.grammars.for_sampling(sampling, [entry.ready.first_token]) if sampling.grammar else None
        entry.runtime = (params, generator, matcher)

    def step(self, batch) -> tuple[list[int], list]:
        """Returns one token id and wire logprobs (or None) per entry of ``batch``. An entry whose grammar is
        complete after its token gets ``grammar_done`` (the core ends it with "stop")."""
        from gpu.grammar import accept_tokens, batch_allowed
        from gpu.sampling import token_logprobs

        native = getattr(self.model, "native", False)
        if native:
            from gpu.lowbit_cpu import set_threads

            set_threads(self.threads)
        try:
            logits = self.model.decode(self.kv, [e.last_token for e in batch], [e.position for e in batch],
                                       [e.blocks for e in batch])
        finally:
            if native:   # a colocated actor's prefill (its last-token steps too) stays on one thread
                set_threads(1)
        params = [e.runtime[0] for e in batch]
        histories = [(e.ready.prompt_ids, e.output_ids) if p.has_penalties else None for e, p in zip(batch, params)]
        matchers = [e.runtime[2] for e in batch]
        tokens_left = [p.max_tokens - e.output_tokens for e, p in zip(batch, params)]
        allowed = batch_allowed(matchers, logits.shape[-1], tokens_left)
        tokens = self.sampler.sample(logits, params, [e.runtime[1] for e in batch], histories, allowed)
        accept_tokens(matchers, tokens)
        for entry, matcher in zip(batch, matchers):
            entry.grammar_done = matcher is not None and matcher.is_terminated()
        if any(p.logprobs is not None for p in params):
            logprobs = [logprobs_to_wire(lp) for lp in token_logprobs(logits, tokens, [p.logprobs for p in params])]
        else:
            logprobs = [None] * len(batch)
        return [int(t) for t in tokens], logprobs
