"""Build a `tokenizers.Tokenizer` from the tokenizer metadata that a GGUF file carries.

A GGUF file has no tokenizer.json: llama.cpp stores the vocabulary, the BPE merges, a type per
token and the special token ids as metadata (``tokenizer.ggml.*``), plus a short name for the
pre-tokenizer the vocabulary was trained with (``tokenizer.ggml.pre``). This module turns that
back into a Hugging Face ``tokenizers`` pipeline.

Supported: ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE). Sentencepiece ("llama") and the
other llama.cpp tokenizer models raise NotImplementedError.

This module must not import torch or transformers (the frontend loads it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import IntEnum
from pathlib import Path
from typing import Any

import structlog
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

log = structlog.get_logger(__name__)

GGUF_MAGIC = b"GGUF"


class GGUFTokenType(IntEnum):
    """Values of ``tokenizer.ggml.token_type`` (llama.cpp's token attributes)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# --- pre-tokenizer flavours (tokenizer.ggml.pre) -------------------------------------------------
# The split patterns below are the published pre-tokenization patterns of those model families.

# Llama 3 style: case-insensitive contractions, letters with one leading non-letter, numbers in
# groups of up to three digits, punctuation runs that swallow trailing newlines.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 style: as Llama 3 but every digit is its own piece.
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Vocabularies trained with every digit split off first, then the GPT-2 byte-level pattern
# (StarCoder lineage; SmolLM/SmolLM2 ship exactly Sequence[Digits(individual), ByteLevel]).
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva-7b"})
_GPT2 = frozenset({"default", "gpt-2", "gpt2"})
_LLAMA3 = frozenset({"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "falcon3"})
_QWEN2 = frozenset({"qwen2", "deepseek-r1-qwen"})


def byte_level_pre_tokenizer(flavour: str | None) -> pre_tokenizers.PreTokenizer:
    """The byte-level pre-tokenizer for a ``tokenizer.ggml.pre`` name (GPT-2's pattern when unknown)."""
    name = (flavour or "default").lower()
    if name in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    for names, pattern in ((_LLAMA3, _LLAMA3_PATTERN), (_QWEN2, _QWEN2_PATTERN)):
        if name in names:
            return pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
    if name not in _GPT2:
        log.warning("gguf_unknown_pre_tokenizer", pre=flavour, fallback="gpt-2 byte-level pattern")
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


# --- byte-level spelling ------------------------------------------------------------------------


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies.

    Bytes that are printable Latin-1 characters stand for themselves; the other 68 bytes are
    given the code points 256, 257, ... in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_TO_CHAR = _byte_to_char()
_BYTE_ALPHABET = frozenset(_BYTE_TO_CHAR.values())


def byte_level_spelling(text: str) -> str:
    """``text`` as a byte-level BPE vocabulary spells it (" hi" -> "Ġhi")."""
    return "".join(_BYTE_TO_CHAR[b] for b in text.encode("utf-8"))


# --- the result -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GGUFTokenizer:
    """A tokenizer rebuilt from GGUF metadata plus the settings the wrapper needs."""

    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    pad_token_id: int | None
    add_bos_token: bool
    add_eos_token: bool
    chat_templates: dict[str, str] = field(default_factory=dict)  # "default" plus named ones

    def token(self, token_id: int | None) -> str | None:
        return None if token_id is None else self.backend.id_to_token(token_id)


def is_gguf_file(path: str | Path) -> bool:
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with p.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def load_gguf_tokenizer(path: str | Path) -> GGUFTokenizer:
    """Read the ``tokenizer.*`` metadata of a GGUF file and build its tokenizer."""
    # The shared GGUF header parser: plain struct/numpy, much faster than gguf.GGUFReader, which
    # builds a numpy view per token string (about 5 s for a 49k vocabulary on a small CPU).
    from vllm_actors.models.config import read_gguf_header

    metadata = read_gguf_header(path).metadata
    log.debug("gguf_tokenizer_metadata_read", path=str(path))
    return tokenizer_from_gguf_metadata(metadata, source=str(path))


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str = "<metadata>") -> GGUFTokenizer:
    """Build the tokenizer that GGUF metadata (key -> decoded value) describes."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{source}: no tokenizer.ggml.model in the GGUF metadata; the file carries no tokenizer")
    if model == "llama":
        raise NotImplementedError(
            f"{source}: sentencepiece GGUF tokenizers (tokenizer.ggml.model='llama') are not supported yet; "
            "point --tokenizer at the model's Hugging Face tokenizer directory instead"
        )
    if model != "gpt2":
        raise NotImplementedError(
            f"{source}: GGUF tokenizer model {model!r} is not supported (only 'gpt2' byte-level BPE is)"
        )
    tokens: list[str] = list(metadata["tokenizer.ggml.tokens"])
    raw_types = metadata.get("tokenizer.ggml.token_type")
    types: list[int] = [int(t) for t in raw_types] if raw_types is not None else [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"{source}: {len(types)} token types for {len(tokens)} tokens")

    def special_id(key: str) -> int | None:
        value = metadata.get(f"tokenizer.ggml.{key}")
        if value is None:
            return None
        token_id = int(value)
        if not 0 <= token_id < len(tokens):
            log.warning("gguf_special_id_out_of_range", key=key, token_id=token_id, vocab=len(tokens))
            return None
        return token_id

    bos, eos = special_id("bos_token_id"), special_id("eos_token_id")
    unk, pad = special_id("unknown_token_id"), special_id("padding_token_id")

    backend = _byte_level_bpe(tokens, types, metadata.get("tokenizer.ggml.merges"), source)
    backend.pre_tokenizer = byte_level_pre_tokenizer(metadata.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    _register_added_tokens(backend, tokens, types, named={i for i in (bos, eos, unk, pad) if i is not None})

    return GGUFTokenizer(
        backend=backend,
        bos_token_id=bos,
        eos_token_id=eos,
        unk_token_id=unk,
        pad_token_id=pad,
        # llama.cpp's default for byte-level vocabularies without the flag is to add no BOS.
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_templates=_chat_templates(metadata),
    )


def _byte_level_bpe(tokens: list[str], types: list[int], merges: Any, source: str) -> BackendTokenizer:
    vocab: dict[str, int] = {}
    duplicates = 0
    for token_id, (token, token_type) in enumerate(zip(tokens, types, strict=True)):
        # Model tokens are stored in byte-level spelling already; added tokens (control and
        # user-defined) are stored as raw text and keep that spelling, so the added-token matcher
        # and the vocabulary agree on their id.
        added = token_type in (GGUFTokenType.CONTROL, GGUFTokenType.USER_DEFINED)
        key = token if added or set(token) <= _BYTE_ALPHABET else byte_level_spelling(token)
        if key in vocab:
            duplicates += 1
            continue
        vocab[key] = token_id
    if duplicates:
        log.warning("gguf_duplicate_tokens", source=source, count=duplicates)
    if merges is None:
        raise ValueError(f"{source}: byte-level BPE GGUF without tokenizer.ggml.merges")
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep:
            raise ValueError(f"{source}: malformed merge {merge!r}")
        pairs.append((left, right))
    return BackendTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))


def _register_added_tokens(backend: BackendTokenizer, tokens: list[str], types: list[int], named: set[int]) -> None:
    """Control tokens (and the named bos/eos/unk/pad) become special added tokens, user-defined
    tokens plain added tokens: both are matched whole in the input instead of being BPE-split."""
    special = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        if t == GGUFTokenType.CONTROL or i in named
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == GGUFTokenType.USER_DEFINED and i not in named
    ]
    vocab_size = backend.get_vocab_size(with_added_tokens=False)
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)
    grown = backend.get_vocab_size(with_added_tokens=True) - vocab_size
    if grown:
        log.warning("gguf_added_tokens_grew_vocab", count=grown)


def _chat_templates(metadata: Mapping[str, Any]) -> dict[str, str]:
    templates: dict[str, str] = {}
    default = metadata.get("tokenizer.chat_template")
    if isinstance(default, str):
        templates["default"] = default
    for name in metadata.get("tokenizer.chat_templates") or ():
        named = metadata.get(f"tokenizer.chat_template.{name}")
        if isinstance(named, str):
            templates[str(name)] = named
    return templates
