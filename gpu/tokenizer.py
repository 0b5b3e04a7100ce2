"""Text <-> token ids, chat templates and streaming detokenization, without torch or transformers.

A :class:`Tokenizer` is built either from a GGUF file's metadata (llama.cpp's ``tokenizer.ggml.*`` keys; only
byte-level BPE, ``tokenizer.ggml.model = "gpt2"``) or from a Hugging Face directory's ``tokenizer.json``, and
wraps a ``tokenizers.Tokenizer``. Loading a GGUF reads only the header (see :mod:`gpu.gguf_meta`; with a
``cache_dir``, from the model cache's JSON copy of it: ~0.2 s instead of ~4 s), so the API process can afford it.
"""
from __future__ import annotations

import functools

import json
import os
import pathlib
from datetime import datetime
from typing import Any, Iterable, Sequence

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _HFTokenizer

from pdserve.errors import InvalidRequestError, ModelLoadError

__all__ = ["Tokenizer", "IncrementalDetokenizer", "bytes_to_unicode"]

# llama.cpp token types (llama_token_type in llama.h / gguf.TokenType).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Pre-tokenizer split regexes by ``tokenizer.ggml.pre`` (source: llama.cpp src/llama-vocab.cpp, the
# ``LLAMA_VOCAB_PRE_TYPE_*`` cases of llm_tokenizer_bpe). Types not listed use GPT-2's ByteLevel regex.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLIT_BY_PRE = {
    "llama3": _LLAMA3_SPLIT,
    "llama-v3": _LLAMA3_SPLIT,
    "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT,
    "deepseek-r1-qwen": _QWEN2_SPLIT,
}
# Pre-tokenizers that isolate every numeric character (\p{N}) before GPT-2's regex: llama.cpp's regex list
# ["\p{N}", gpt2] for these types, which equals SmolLM2's tokenizer.json (Digits(individual_digits=True) then
# ByteLevel). transformers' GGUF converter ignores "smollm" and uses ByteLevel alone, so it differs from
# this on whitespace runs before a digit ("x  1": ours "x","ĠĠ","1"; it "x","Ġ","Ġ","1") and on a space
# before a non-ASCII numeric (" ²").
_DIGIT_PRE = ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva")


@functools.lru_cache(maxsize=1)
def _byte_of_char() -> dict[str, int]:
    """The inverse of :func:`bytes_to_unicode`: vocabulary character -> byte."""
    return {c: b for b, c in bytes_to_unicode().items()}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies.

    Source: openai/gpt-2 ``encoder.py`` ``bytes_to_unicode``.
    """
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


class Tokenizer:
    """Byte-level BPE tokenizer plus chat template.

    Construct with :meth:`load`, :meth:`from_gguf` or :meth:`from_hf_dir`. Thread-safe for concurrent
    ``encode``/``decode`` (the underlying ``tokenizers`` object is immutable after construction).
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        name: str,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        vocab_size: int,
        template_vars: dict[str, Any] | None = None,
    ):
        self._tok = backend
        self._name = name
        self._bos_token_id = bos_token_id
        self._eos_token_ids = tuple(int(i) for i in eos_token_ids)
        self._vocab_size = int(vocab_size)
        self._chat_template_src = chat_template
        self._chat_template = None
        self._template_vars = dict(template_vars or {})

    # -- construction -------------------------------------------------------------------------------------

    @classmethod
    def load(cls, path: str | os.PathLike | None = None,
             cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """From a ``.gguf`` file, a Hugging Face directory, or the default model when ``path`` is None.
        ``cache_dir``: as :meth:`from_gguf`.

        Raises:
            ModelLoadError: the path is missing or holds no usable tokenizer.
        """
        if path is None:
            from .model_files import default_model_path

            return cls.from_gguf(default_model_path(), cache_dir)
        p = pathlib.Path(path).expanduser()
        if p.is_dir():
            return cls.from_hf_dir(p)
        if p.is_file() and p.suffix.lower() == ".gguf":
            return cls.from_gguf(p, cache_dir)
        if not p.exists():
            raise ModelLoadError(f"{p}: no such model file or directory")
        raise ModelLoadError(f"{p}: not a .gguf file or a Hugging Face directory; cannot load a tokenizer")

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> "Tokenizer":
        """Build the tokenizer a GGUF file describes (byte-level BPE only).

        Vocabulary, merges and token types come from ``tokenizer.ggml.{tokens,merges,token_type}``; control
        (type 3) and user-defined (type 4) tokens become added tokens matched whole in text (control ones are
        special, so ``decode(skip_special_tokens=True)`` drops them). The pre-tokenizer follows
        ``tokenizer.ggml.pre``; for SmolLM it is ``Digits(individual_digits=True)`` then GPT-2's ByteLevel
        regex, as in SmolLM2's own ``tokenizer.json``. ``cache_dir``: the model cache holding the GGUF header
        (``gpu.gguf_meta.read_gguf_header``; written there on first use); None = read the file itself.

        Raises:
            ModelLoadError: not a GGUF file, no tokenizer in it, or a tokenizer model other than ``gpt2``.
        """
        from .gguf_meta import read_gguf_metadata

        p = pathlib.Path(path)
        meta = read_gguf_metadata(p, cache_dir)
        model = meta.get("tokenizer.ggml.model")
        if model is None or "tokenizer.ggml.tokens" not in meta:
            raise ModelLoadError(f"{p}: the GGUF file has no tokenizer (tokenizer.ggml.model/tokens missing)")
        if model != "gpt2":
            raise ModelLoadError(f"{p}: tokenizer model {model!r} is not supported "
                                 "(only byte-level BPE, 'gpt2')")
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges_raw: list[str] | None = meta.get("tokenizer.ggml.merges")
        if not merges_raw:
            raise ModelLoadError(f"{p}: tokenizer.ggml.merges is missing; a BPE tokenizer needs its merges")
        types = meta.get("tokenizer.ggml.token_type")
        types = [TOKEN_TYPE_NORMAL] * len(tokens) if types is None else [int(t) for t in types]

        # Byte-level vocabularies spell every token in GPT-2's byte alphabet; a token written otherwise is
        # respelled from its UTF-8 bytes, except a control or user-defined one: it is matched whole in text as
        # written (DeepSeek's "<｜tool▁calls▁begin｜>"; "<|im_start|>" is in the alphabet anyway).
        spelling = bytes_to_unicode()
        alphabet = set(spelling.values())
        whole = (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED)
        vocab: dict[str, int] = {}
        for i, (tok, ty) in enumerate(zip(tokens, types)):
            key = tok if ty in whole or set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))
            vocab.setdefault(key, i)
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        backend = _HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        pre = meta.get("tokenizer.ggml.pre", "default")
        backend.pre_tokenizer = _byte_level_pre_tokenizer(pre)
        backend.decoder = decoders.ByteLevel()

        special = [AddedToken(t, special=True, normalized=False)
                   for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL and t in vocab]
        user = [AddedToken(t, special=False, normalized=False)
                for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_USER_DEFINED and t in vocab]
        if special:
            backend.add_special_tokens(special)
        if user:
            backend.add_tokens(user)

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos_ids = _gguf_eos_ids(meta)
        _add_bos_eos_processor(backend, meta, tokens, bos, eos_ids)
        template_vars = _gguf_template_vars(meta, tokens, bos, eos_ids)
        return cls(
            backend,
            name=str(meta.get("general.name") or p.stem),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            chat_template=meta.get("tokenizer.chat_template"),
            vocab_size=len(tokens),
            template_vars=template_vars,
        )

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """From a Hugging Face directory: ``tokenizer.json``, plus ``tokenizer_config.json`` (special tokens,
        ``chat_template``), ``chat_template.jinja``, ``config.json`` / ``generation_config.json`` (eos ids).

        Raises:
            ModelLoadError: ``tokenizer.json`` is missing or unreadable.
        """
        d = pathlib.Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise ModelLoadError(f"{d}: tokenizer.json is missing (only fast-tokenizer files are supported)")
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a bare Exception on bad files
            raise ModelLoadError(f"{tj}: cannot load ({e})") from None
        cfg = _read_json_if(d / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        jinja_file = d / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if template is None:
            ct = _read_json_if(d / "chat_template.json")
            template = ct.get("chat_template")

        def tok_str(v: Any) -> str | None:
            if isinstance(v, dict):
                return v.get("content")
            return v if isinstance(v, str) else None

        template_vars = {}
        for var in ("bos_token", "eos_token", "unk_token", "pad_token"):
            s = tok_str(cfg.get(var))
            if s is not None:
                template_vars[var] = s
        model_cfg = _read_json_if(d / "config.json")
        gen_cfg = _read_json_if(d / "generation_config.json")

        bos = model_cfg.get("bos_token_id")
        if bos is None and "bos_token" in template_vars:
            bos = backend.token_to_id(template_vars["bos_token"])
        eos_ids: list[int] = []
        if "eos_token" in template_vars and backend.token_to_id(template_vars["eos_token"]) is not None:
            eos_ids.append(backend.token_to_id(template_vars["eos_token"]))
        for src in (model_cfg, gen_cfg):
            v = src.get("eos_token_id")
            for i in (v if isinstance(v, list) else [] if v is None else [v]):
                if int(i) not in eos_ids:
                    eos_ids.append(int(i))
        template_vars.setdefault("bos_token", backend.id_to_token(bos) if bos is not None else "")
        template_vars.setdefault("eos_token", backend.id_to_token(eos_ids[0]) if eos_ids else "")
        return cls(
            backend,
            name=d.resolve().name,
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=eos_ids,
            chat_template=template,
            vocab_size=backend.get_vocab_size(with_added_tokens=True),
            template_vars=template_vars,
        )

    # -- properties ---------------------------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._vocab_size

    @property
    def chat_template(self) -> str | None:
        return self._chat_template_src

    @property
    def backend(self) -> _HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer`` (e.g. to save a ``tokenizer.json``)."""
        return self._tok

    # -- encode / decode ----------------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Control tokens written in the text (``<|im_start|>``) become their ids.

        ``add_special_tokens`` adds what the model's post-processor adds (BOS where the GGUF's
        ``tokenizer.ggml.add_bos_token`` is true; nothing for SmolLM2).
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True,
               keep: frozenset[int] = frozenset()) -> str:
        """Text of ``ids``; bytes that do not form complete UTF-8 characters decode to U+FFFD. With
        ``skip_special_tokens`` the special tokens are left out, except those in ``keep`` (token ids: the markers
        an output parser reads, e.g. ``<tool_call>`` declared special by the model files, as vLLM's parsers turn
        ``skip_special_tokens`` off for them).

        Raises:
            InvalidRequestError: an id is outside ``[0, vocab_size)``.
        """
        ids = list(ids)
        for i in ids:
            if not 0 <= i < self._vocab_size:
                raise InvalidRequestError(f"token id {i} is outside the vocabulary [0, {self._vocab_size})")
        if skip_special_tokens and keep:
            special = self.special_ids
            ids, skip_special_tokens = [i for i in ids if i in keep or i not in special], False
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        """Ids of the special added tokens (what ``decode(skip_special_tokens=True)`` leaves out)."""
        return frozenset(int(i) for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    def special_ids_of(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those of ``texts`` that are one special token each (e.g. a parser's markers)."""
        ids = (self._tok.token_to_id(t) for t in texts)
        return frozenset(i for i in ids if i is not None and i in self.special_ids)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (byte-level BPE: the vocabulary string mapped back through GPT-2's
        byte table; a token outside it, e.g. an added special token, as its UTF-8). A token may hold part of a
        multi-byte character, so these bytes need not be valid UTF-8 alone (OpenAI's logprobs ``bytes``).

        Raises:
            ValueError: ``token_id`` is outside the vocabulary.
        """
        piece = self._tok.id_to_token(int(token_id))
        if piece is None:
            raise ValueError(f"token id {token_id} is outside the vocabulary")
        table = _byte_of_char()
        if all(c in table for c in piece):
            return bytes(table[c] for c in piece)
        return piece.encode("utf-8")

    # -- chat template ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        **kwargs: Any,
    ) -> str:
        """Render ``messages`` with the model's chat template (jinja2, sandboxed, as transformers does).

        The template sees ``messages``, ``add_generation_prompt``, ``bos_token``, ``eos_token`` (and
        ``unk_token``/``pad_token`` where known), the helpers ``raise_exception(msg)`` and
        ``strftime_now(fmt)``, and any extra ``kwargs`` (e.g. ``tools``).

        Raises:
            InvalidRequestError: the model has no chat template, or the template rejected the messages
                (its ``raise_exception``) or failed to render them.
        """
        template = self._compiled_template()
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **{**self._template_vars, **kwargs},
            )
        except _TemplateRaised as e:
            raise InvalidRequestError(f"chat template rejected the messages: {e}", param="messages") from None
        except Exception as e:  # jinja2 TemplateError, TypeError/KeyError from odd message shapes
            raise InvalidRequestError(
                f"chat template failed to render the messages ({type(e).__name__}: {e})", param="messages"
            ) from None

    def set_chat_template(self, source: str) -> None:
        """Use ``source`` (jinja2) as the chat template instead of the model's (``--chat-template FILE``).

        Raises:
            ModelLoadError: the template does not compile.
        """
        self._chat_template = _compile_template(source)
        self._chat_template_src = source

    def _compiled_template(self):
        if self._chat_template is None:
            if not self._chat_template_src:
                raise InvalidRequestError(
                    f"model {self._name!r} has no chat template; use the completions endpoint",
                    param="messages")
            self._chat_template = _compile_template(self._chat_template_src)
        return self._chat_template


class _TemplateRaised(Exception):
    """Raised by a chat template's ``raise_exception``."""


def compile_chat_template(source: str):
    """Compile a chat template as :meth:`Tokenizer.apply_chat_template` would (raises ModelLoadError)."""
    return _compile_template(source)


def _compile_template(source: str):
    """Compile like transformers' ``_compile_jinja_template``: immutable sandbox, trim/lstrip blocks,
    loop controls, ``tojson`` without ASCII escaping."""
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise _TemplateRaised(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ModelLoadError(f"the model's chat template does not compile: {e}") from None


def _byte_level_pre_tokenizer(pre: str):
    split = _SPLIT_BY_PRE.get(pre)
    if split is not None:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _read_json_if(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            v = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"{path}: cannot read ({e})") from None
    return v if isinstance(v, dict) else {}


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas, never splitting a UTF-8 character.

    A byte-level token can end in the middle of a multi-byte character (emoji, CJK); decoding it alone gives
    U+FFFD. We decode a small window ``ids[prefix_offset:]`` and compare it with ``ids[prefix_offset:
    read_offset]`` (text already emitted); new text is emitted only when the window does not end in U+FFFD.
    Source: vLLM's ``detokenize_incrementally`` (vllm/transformers_utils/detokenizer_utils.py) and TGI's
    ``Model.decode_token``.

    ``"".join(push(i) for i in ids) + flush() == tokenizer.decode(ids, skip_special_tokens, keep)``
    (``keep``: special token ids written out even when special tokens are skipped, see :meth:`Tokenizer.decode`).
    """

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True,
                 keep: frozenset[int] = frozenset()):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._keep = frozenset(keep)
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start: ids before it are never decoded again
        self._read_offset = 0  # ids before it have been emitted as text

    @property
    def token_ids(self) -> list[int]:
        """Every id pushed so far (a copy)."""
        return list(self._ids)

    def push(self, token_id: int) -> str:
        """Append one id; return the text it completes ("" while a character is still incomplete)."""
        self._ids.append(int(token_id))
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip, keep=self._keep)
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text held back at the end of the stream (an incomplete character decodes to U+FFFD here)."""
        if self._read_offset == len(self._ids):
            return ""
        decode = functools.partial(self._tokenizer.decode, skip_special_tokens=self._skip, keep=self._keep)
        prefix_text = decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]


def _gguf_eos_ids(meta: dict) -> list[int]:
    """End-of-sequence ids a GGUF names (eos, end-of-turn, end-of-message), first one first, no repeats."""
    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and int(v) not in eos_ids:
            eos_ids.append(int(v))
    return eos_ids


def _add_bos_eos_processor(backend, meta: dict, tokens: list[str], bos, eos_ids: list[int]) -> None:
    """``tokenizer.ggml.add_bos_token`` / ``add_eos_token``: a post-processor that adds them around the text."""
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_ids
    if not (add_bos or add_eos):
        return
    head = [tokens[bos]] if add_bos else []
    tail = [tokens[eos_ids[0]]] if add_eos else []
    specials = ([(tokens[bos], int(bos))] if add_bos else []) + ([(tokens[eos_ids[0]], eos_ids[0])] if add_eos else [])
    backend.post_processor = processors.TemplateProcessing(
        single=[*head, "$A", *tail], pair=[*head, "$A", *tail, *head, "$B:1", *tail], special_tokens=specials)


def _gguf_template_vars(meta: dict, tokens: list[str], bos, eos_ids: list[int]) -> dict[str, str]:
    """The special-token strings a chat template may use (bos_token, eos_token, unk_token, pad_token)."""
    template_vars = {
        "bos_token": tokens[bos] if bos is not None and 0 <= bos < len(tokens) else "",
        "eos_token": tokens[eos_ids[0]] if eos_ids and 0 <= eos_ids[0] < len(tokens) else "",
    }
    for var, key in (("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None and 0 <= int(v) < len(tokens):
            template_vars[var] = tokens[int(v)]
    return template_vars
