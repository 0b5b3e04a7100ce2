"""Our GGUF tokenizer against Hugging Face's tokenizer built from the same GGUF file."""
from __future__ import annotations

import subprocess
import sys

import orjson
import pytest

from gpu.tokenizer import IncrementalDetokenizer, Tokenizer
from pdserve.errors import InvalidRequestError, ModelLoadError

TEXTS = [
    "Hello, world!",
    "  leading spaces,\ttabs\nand\n\nnewlines  ",
    "Café naïve résumé façade Ünïcödé",
    "日本語のテキストです。中文也可以。한국어도 돼요.",
    "Emoji 😀🎉 family 👩‍👩‍👧 flag 🇫🇷!",
    "In 2024, 12345 people paid $3.50 for 1,000,000 items (x=1;y=22;z=333).",
    "def f(x):\n    return x**2  # square\n\nprint(f(3))\n",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "Ελληνικά русский текст עברית العربية",
    "don't they'll I'm you're we've",
    "<|endoftext|><jupyter_code>import os<file_sep>",
]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_gives_the_same_ids_as_hf(tok, hf_tok, text):
    assert tok.encode(text) == hf_tok.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=True) == hf_tok.encode(text, add_special_tokens=True)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_gives_the_same_text_as_hf(tok, hf_tok, text):
    ids = hf_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)


def test_whitespace_before_digits_is_split_like_llama_cpp_smollm(tok):
    # tokenizer.ggml.pre = "smollm": llama.cpp isolates each \p{N} before GPT-2's regex, like SmolLM2's own
    # tokenizer.json (Digits + ByteLevel). transformers' GGUF converter ignores "smollm" and gives
    # ["x", "Ġ", "Ġ", "1"] here; we follow the tokenizer the model was trained with.
    assert [tok.id_to_token(i) for i in tok.encode("x  1")] == ["x", "ĠĠ", "1"]
    assert [tok.id_to_token(i) for i in tok.encode("v 12")] == ["v", "Ġ", "1", "2"]


def test_control_tokens_written_in_text_become_their_ids(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_properties_come_from_the_gguf_metadata(tok):
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.vocab_size == 49152
    assert tok.name
    assert tok.chat_template and "<|im_start|>" in tok.chat_template


def test_chat_template_renders_like_hf(tok, hf_tok):
    ours = tok.apply_chat_template(FRANCE, add_generation_prompt=True)
    assert ours == hf_tok.apply_chat_template(FRANCE, tokenize=False, add_generation_prompt=True)
    assert ours.endswith("<|im_start|>assistant\n")
    multi = [{"role": "system", "content": "Be brief."}, *FRANCE, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": "And of Italy?"}]
    for gen in (True, False):
        assert tok.apply_chat_template(multi, add_generation_prompt=gen) == hf_tok.apply_chat_template(
            multi, tokenize=False, add_generation_prompt=gen)
    assert tok.encode(ours) == hf_tok.apply_chat_template(FRANCE, tokenize=True, add_generation_prompt=True,
                                                          return_dict=False)


STRICT_TEMPLATE = ("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
                   "{{ bos_token }}{{ messages[0]['content'] }}")


def test_chat_template_raise_exception_becomes_invalid_request(tok):
    strict = Tokenizer(tok.backend, name="t", bos_token_id=1, eos_token_ids=(2,), vocab_size=tok.vocab_size,
                       chat_template=STRICT_TEMPLATE,
                       template_vars={"bos_token": "<|im_start|>"})
    assert strict.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>x"
    with pytest.raises(InvalidRequestError, match="user first"):
        strict.apply_chat_template([{"role": "system", "content": "x"}])


def test_a_model_without_chat_template_refuses_chat(tok):
    bare = Tokenizer(tok.backend, name="bare", bos_token_id=None, eos_token_ids=(), chat_template=None,
                     vocab_size=tok.vocab_size)
    with pytest.raises(InvalidRequestError):
        bare.apply_chat_template(FRANCE)


def test_decode_rejects_ids_outside_the_vocabulary(tok):
    with pytest.raises(InvalidRequestError):
        tok.decode([5, tok.vocab_size])


def test_loading_a_missing_path_names_it(tmp_path):
    with pytest.raises(ModelLoadError, match="nope"):
        Tokenizer.load(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


def test_tokenizer_loads_from_gguf_without_torch(gguf_path):
    """The API process builds its tokenizer from the GGUF header alone and checks grammars: torch is never
    imported (it would cost the API ~2 s of start-up)."""
    code = (
        "import sys\n"
        "from gpu.grammar import GrammarCompiler, json_schema_grammar\n"
        "from gpu.tokenizer import Tokenizer\n"
        f"tk = Tokenizer.load({str(gguf_path)!r})\n"
        "assert tk.encode('hello') == [28120], tk.encode('hello')\n"
        "GrammarCompiler(tokenizer=tk).check(json_schema_grammar({'type': 'object'}))\n"
        "assert 'torch' not in sys.modules\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_a_tokenizer_from_the_cached_gguf_header_gives_the_same_ids_as_one_built_from_the_file(
        tok, gguf_path, tmp_path, monkeypatch):
    """The model cache's JSON copy of the GGUF header (gpu/gguf_meta.py) builds the same tokenizer and model
    config as the file itself. The first load writes the copy; the one compared is built from the copy alone
    (reading the GGUF file then fails the test), and a marker written into the copy comes back."""
    import gpu.gguf_meta
    from gpu.gguf_meta import header_cache_path
    from gpu.loader import load_config

    Tokenizer.load(gguf_path, cache_dir=tmp_path)   # reads the file, writes the copy
    cache_file, key = header_cache_path(gguf_path, tmp_path)
    assert orjson.loads(cache_file.read_bytes())["key"] == key
    assert list(tmp_path.iterdir()) == [cache_file]   # no temporary file left behind

    def no_file(path):
        raise AssertionError(f"read the GGUF file {path}, not its cached header")
    monkeypatch.setattr(gpu.gguf_meta, "open_gguf", no_file)
    cached = Tokenizer.load(gguf_path, cache_dir=tmp_path)
    for text in TEXTS:
        assert cached.encode(text) == tok.encode(text)
        assert cached.encode(text, add_special_tokens=True) == tok.encode(text, add_special_tokens=True)
    ids = tok.encode(TEXTS[4] + TEXTS[7])
    assert cached.decode(ids, skip_special_tokens=False) == tok.decode(ids, skip_special_tokens=False)
    assert (cached.bos_token_id, cached.eos_token_ids, cached.vocab_size, cached.name, cached.chat_template) == (
        tok.bos_token_id, tok.eos_token_ids, tok.vocab_size, tok.name, tok.chat_template)
    from_cache = load_config(gguf_path, cache_dir=tmp_path)
    monkeypatch.undo()
    assert from_cache == load_config(gguf_path)

    blob = orjson.loads(cache_file.read_bytes())
    blob["meta"]["tokenizer.chat_template"] = "{{ 'from the cache' }}"
    cache_file.write_bytes(orjson.dumps(blob))
    assert Tokenizer.load(gguf_path, cache_dir=tmp_path).chat_template == "{{ 'from the cache' }}"


@pytest.mark.parametrize("damage", [b"{\"key\": \"trunc", b"[1, 2]", b'{"key": "another model", "meta": {}}',
                                    b"\xff\xfe not json"])
def test_a_damaged_or_stale_cached_gguf_header_is_rebuilt_not_trusted(tok, gguf_path, tmp_path, damage, caplog):
    from gpu.gguf_meta import header_cache_path

    cache_file, key = header_cache_path(gguf_path, tmp_path)
    cache_file.write_bytes(damage)
    with caplog.at_level("WARNING", logger="pdserve.gguf_meta"):
        rebuilt = Tokenizer.load(gguf_path, cache_dir=tmp_path)
    assert "rebuilding it" in caplog.text
    assert rebuilt.encode(TEXTS[5]) == tok.encode(TEXTS[5])
    assert orjson.loads(cache_file.read_bytes())["key"] == key   # rewritten whole


def test_an_unwritable_cache_dir_costs_time_not_the_tokenizer(tok, gguf_path, tmp_path, caplog):
    blocker = tmp_path / "a-file"   # a cache "directory" that is a file: mkdir fails
    blocker.write_text("")
    with caplog.at_level("WARNING", logger="pdserve.gguf_meta"):
        assert Tokenizer.load(gguf_path, cache_dir=blocker / "models").encode(TEXTS[0]) == tok.encode(TEXTS[0])
    assert "cannot save the GGUF header" in caplog.text


# -- incremental detokenization ------------------------------------------------------------------------

STREAM_TEXTS = [
    "Emoji 😀🎉👩‍👩‍👧🇫🇷 then text.",
    "日本語のテキスト、中文文本和한국어。",
    "Mixed: café 😀 東京 ok",
]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_streaming_never_emits_half_a_character(tok, text):
    ids = tok.encode(text)
    # The point of the test: some tokens of these texts decode to an incomplete UTF-8 sequence alone.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok)
    chunks = [detok.push(i) for i in ids]
    chunks.append(detok.flush())
    assert "".join(chunks) == tok.decode(ids) == text
    assert not any("\ufffd" in c for c in chunks)
    assert "" in chunks[:-1]  # some character was held back until its last byte arrived


def test_streaming_skips_special_tokens_and_matches_decode(tok):
    ids = tok.encode("<|im_start|>assistant\nBonjour 😀<|im_end|>")
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in ids) + detok.flush()
    assert text == tok.decode(ids) == "assistant\nBonjour 😀"
    keep = IncrementalDetokenizer(tok, skip_special_tokens=False)
    text = "".join(keep.push(i) for i in ids) + keep.flush()
    assert text == tok.decode(ids, skip_special_tokens=False)


def test_flush_releases_an_incomplete_character_at_the_end(tok):
    ids = tok.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte(s) never arrive
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.push(i) for i in cut)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(cut)
    assert detok.flush() == ""


def test_a_gguf_that_asks_for_bos_gets_it_and_keeps_user_defined_tokens_whole(tmp_path):
    import gguf

    from gpu.tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    tokens = ["<s>", "</s>", "<think>", *byte_chars, "he", "Ġhe"]
    types = [3, 3, 4] + [1] * (len(byte_chars) + 2)
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(["h e", "Ġ he"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(True)
    w.add_chat_template("{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    t = Tokenizer.load(path)
    he, space_he = tokens.index("he"), tokens.index("Ġhe")
    assert t.encode("he he") == [he, space_he]
    assert t.encode("he he", add_special_tokens=True) == [0, he, space_he]
    assert t.encode("<think>he") == [2, he]
    assert t.decode([0, 2, he, 1]) == "<think>he"  # control tokens skipped, user-defined kept
    assert t.bos_token_id == 0 and t.eos_token_ids == (1,)
    assert t.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x</s>"


def test_a_gguf_control_token_outside_the_byte_alphabet_is_one_special_token(tmp_path):
    """DeepSeek's markers (full-width bars, U+2581) as GGUF control tokens: matched whole in text, skipped by
    ``decode`` unless kept (a parser's markers), and kept markers stream exactly as ``decode`` gives them."""
    import gguf

    from gpu.tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    begin, sep = "<｜tool▁calls▁begin｜>", "<｜tool▁sep｜>"
    tokens = ["<s>", "</s>", begin, sep, *byte_chars, "he"]
    path = tmp_path / "tok.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3, 3] + [1] * (len(byte_chars) + 1))
    w.add_token_merges(["h e"])
    w.add_eos_token_id(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    t = Tokenizer.load(path)
    he = tokens.index("he")
    ids = t.encode(f"he{begin}he{sep}")
    assert ids == [he, 2, he, 3]
    assert t.special_ids == {0, 1, 2, 3} and t.special_ids_of([begin, "he", "<none>"]) == {2}
    assert t.decode(ids) == "hehe"
    assert t.decode(ids + [1], keep=frozenset({2})) == f"he{begin}he"
    detok = IncrementalDetokenizer(t, keep=frozenset({2, 3}))
    assert "".join(detok.push(i) for i in ids + [1]) + detok.flush() == f"he{begin}he{sep}"
