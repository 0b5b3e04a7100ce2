"""bench/engine: the pieces its comparisons rest on (the figures are not asserted: the machine is shared)."""
from __future__ import annotations

import pytest
import torch

from bench import engine as be


def test_gemv_bandwidth_is_positive_and_restores_the_thread_count():
    before = torch.get_num_threads()
    assert be.gemv_bandwidth(8 << 20, reps=2, threads=1) > 0
    assert torch.get_num_threads() == before


@pytest.mark.timeout(240)
def test_hf_batched_generate_and_our_model_make_the_same_greedy_tokens_on_the_same_prompts():
    """The comparison is like for like: same ids in, same greedy ids out, left padding included. (Prompts whose
    greedy continuation does not start with EOS: HF's min_new_tokens masks EOS, pdserve's ignore_eos does not,
    so after an EOS the texts differ while the work per token stays the same.)"""
    from gpu.model import LlamaModel
    from gpu.model_files import default_model_path
    from gpu.tokenizer import Tokenizer

    path = default_model_path()
    tok = Tokenizer.load(path)
    prompts = [tok.encode(be.PROMPTS[i]) for i in (0, 4, 5)]
    assert len({len(p) for p in prompts}) > 1  # different lengths: the padded path
    hf = be.load_hf(path)
    ours = LlamaModel.from_path(path, progress=False)
    theirs = be.hf_run(hf, prompts, 4, tok.eos_token_ids[0])
    mine = be.ours_run(ours, prompts, 4)
    assert theirs["tokens"] == mine["tokens"] == 12
    assert theirs["ids"] == mine["ids"]
    assert mine["decode_tok_s"] > 0 and mine["prefill_s"] > 0
