"""bench/decode_bandwidth: the byte count it divides by is what a step reads (the figures are not asserted:
the machine is shared)."""
from __future__ import annotations

import pytest

from bench import decode_bandwidth as bdb


def test_the_streamed_bytes_are_the_stacked_layers_and_the_int8_output_projection(capsys):
    from gpu.model import LlamaModel

    model = LlamaModel.from_path(None, progress=False, weights="auto")
    layers, head = bdb.streamed_bytes(model)
    per_layer = sum(lay.qkv.weight_bytes + lay.o.weight_bytes + lay.gate_up.weight_bytes + lay.down.weight_bytes
                    + lay.ln_attn.nbytes + lay.ln_mlp.nbytes for lay in model.layers)
    assert layers == per_layer   # the layers' own linears are views of the stacks
    assert model.lm_head.kind == "int8" and head == model.lm_head.weight_bytes < model.config.vocab_size * \
        model.config.hidden_size * 2
    assert bdb.main(["--steps", "2", "--read-mib", "8", "--itl-ms", "9"]) == 0
    out = capsys.readouterr().out
    assert "decode step / read bandwidth" in out and "engine ITL 9.00 ms" in out


def test_a_model_without_the_one_call_step_is_refused():
    from gpu.model import LlamaModel

    with pytest.raises(ValueError, match="one-call decode step"):
        bdb.streamed_bytes(LlamaModel.from_path(None, progress=False, weights="float32"))
