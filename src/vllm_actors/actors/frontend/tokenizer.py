"""The frontend's tokenizer: a `tokenizers.Tokenizer` plus the settings around it.

Loads either a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json,
optional special_tokens_map.json / chat_template.jinja / chat_template.json) or a GGUF file
(see gguf_tokenizer). Encoding, decoding and chat templates behave like transformers'
tokenizers for the same files, without importing torch or transformers.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, overload

import structlog
from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as BackendTokenizer

from vllm_actors.actors.frontend.chat_template import render_chat_template, select_chat_template
from vllm_actors.actors.frontend.errors import TooManyTokens
from vllm_actors.actors.frontend.gguf_tokenizer import is_gguf_file, load_gguf_tokenizer

log = structlog.get_logger(__name__)

_NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_EXTRA_SPECIAL_LISTS = ("additional_special_tokens", "extra_special_tokens")
_RELEASE_GIL_CHARS = 16384  # texts from this length on are encoded without holding the GIL


class Tokenizer:
    """A loaded tokenizer. Build it with `Tokenizer.from_path` / `load_tokenizer`."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        special_tokens: Mapping[str, str | None] | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_templates: Mapping[str, str] | None = None,
        name_or_path: str = "",
    ) -> None:
        self.backend = backend
        self.name_or_path = name_or_path
        self.special_tokens: dict[str, str] = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_templates: dict[str, str] = dict(chat_templates or {})
        self.bos_token_id = self._id_of(self.special_tokens.get("bos_token"))
        self.eos_token_id = self._id_of(self.special_tokens.get("eos_token"))
        self.pad_token_id = self._id_of(self.special_tokens.get("pad_token"))
        self.unk_token_id = self._id_of(self.special_tokens.get("unk_token"))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._apply_bos_eos_flags(add_bos_token, add_eos_token)
        named_ids = {self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id}
        # Every added token flagged special (what decode(skip_special_tokens=True) drops) plus
        # the named ones.
        self.all_special_ids: set[int] = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        self.all_special_ids.update(i for i in named_ids if i is not None)

    def _apply_bos_eos_flags(self, add_bos: bool, add_eos: bool) -> None:
        """Make encode(add_special_tokens=True) add BOS / EOS when the flags ask for them and the
        tokenizer.json post-processor does not add them already. What the post-processor adds is
        kept either way (transformers 5 ignores the flags of a tokenizer.json directory entirely;
        llama.cpp and transformers 4 honour them)."""
        with_specials = self.backend.encode("a", add_special_tokens=True).ids
        plain = self.backend.encode("a", add_special_tokens=False).ids
        extra = len(with_specials) > len(plain)
        adds_bos = extra and self.bos_token_id is not None and with_specials[0] == self.bos_token_id
        adds_eos = extra and self.eos_token_id is not None and with_specials[-1] == self.eos_token_id
        self.add_bos_token = adds_bos or (add_bos and self.bos_token_id is not None)
        self.add_eos_token = adds_eos or (add_eos and self.eos_token_id is not None)
        if (self.add_bos_token, self.add_eos_token) == (adds_bos, adds_eos):
            return
        if extra and not (adds_bos or adds_eos):
            log.warning("tokenizer_post_processor_replaced", dropped="special tokens other than bos/eos")
        bos, eos = self.bos_token, self.eos_token
        head = [bos] if self.add_bos_token else []
        tail = [eos] if self.add_eos_token else []
        specials = {}
        if self.add_bos_token:
            specials[bos] = self.bos_token_id
        if self.add_eos_token:
            specials[eos] = self.eos_token_id
        self.backend.post_processor = processors.TemplateProcessing(
            single=[*head, "$A", *tail],
            pair=[*head, "$A", *tail, *(f"{t}:1" for t in head), "$B:1", *(f"{t}:1" for t in tail)],
            special_tokens=list(specials.items()),
        )
        log.debug("tokenizer_post_processor_replaced", add_bos=self.add_bos_token, add_eos=self.add_eos_token)

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_path(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face tokenizer directory (or its tokenizer.json) or a GGUF file."""
        p = Path(path).expanduser()
        if p.is_file():
            if is_gguf_file(p):
                return cls._from_gguf(p)
            if p.name == "tokenizer.json":
                return cls._from_hf_dir(p.parent)
            raise ValueError(f"{p}: not a GGUF file or a tokenizer.json")
        if not p.is_dir():
            raise FileNotFoundError(f"tokenizer path {p} does not exist")
        if (p / "tokenizer.json").is_file():
            return cls._from_hf_dir(p)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return cls._from_gguf(ggufs[0])
        if ggufs:
            raise ValueError(f"{p} holds no tokenizer.json but several GGUF files; name one of them")
        raise FileNotFoundError(
            f"{p} has no tokenizer.json (slow sentencepiece/tiktoken-only tokenizers are not supported)"
        )

    @classmethod
    def _from_gguf(cls, path: Path) -> Tokenizer:
        gguf = load_gguf_tokenizer(path)
        special = {
            "bos_token": gguf.token(gguf.bos_token_id),
            "eos_token": gguf.token(gguf.eos_token_id),
            "unk_token": gguf.token(gguf.unk_token_id),
            "pad_token": gguf.token(gguf.pad_token_id),
        }
        log.info("tokenizer_loaded", source="gguf", path=str(path), vocab=gguf.backend.get_vocab_size())
        return cls(
            gguf.backend,
            special_tokens=special,
            add_bos_token=gguf.add_bos_token,
            add_eos_token=gguf.add_eos_token,
            chat_templates=gguf.chat_templates,
            name_or_path=str(path),
        )

    @classmethod
    def _from_hf_dir(cls, path: Path) -> Tokenizer:
        backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
        config = _read_json(path / "tokenizer_config.json")
        special_map = _read_json(path / "special_tokens_map.json")
        # tokenizer.json carries no truncation/padding we want applied to single prompts.
        backend.no_truncation()
        backend.no_padding()

        special: dict[str, str | None] = {}
        for name in _NAMED_SPECIAL_TOKENS:
            value = config.get(name, special_map.get(name))
            special[name] = _token_content(value)
        extra: list[str] = []
        for source in (special_map, config):
            for key in _EXTRA_SPECIAL_LISTS:
                value = source.get(key)
                items: Iterable[Any] = value.values() if isinstance(value, dict) else (value or ())
                extra.extend(c for c in map(_token_content, items) if c)
        _register_config_tokens(backend, config, [c for c in special.values() if c] + extra)

        return cls(
            backend,
            special_tokens=special,
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_templates=_hf_chat_templates(path, config),
            name_or_path=str(path),
        )

    # ------------------------------------------------------------------ text <-> ids
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the model has none)."""
        return self.chat_templates.get("default")

    def __len__(self) -> int:
        return self.vocab_size

    def encode(self, text: str, add_special_tokens: bool = True, *, limit: int | None = None) -> list[int]:
        """The token ids of ``text``; more than ``limit`` of them raise ``TooManyTokens`` (before the
        ids become a Python list). A long text goes through ``encode_batch_fast``, which releases the
        GIL while it works and keeps no per-token offsets and strings (``encode`` holds the GIL
        throughout, ``encode_batch`` frees those offsets under it)."""
        if len(text) >= _RELEASE_GIL_CHARS:
            encoding = self.backend.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0]
        else:
            encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        if limit is not None and len(encoding) > limit:
            raise TooManyTokens(len(encoding), limit)
        return encoding.ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        encodings = self.backend.encode_batch(list(texts), add_special_tokens=add_special_tokens)
        return [e.ids for e in encodings]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str | None: ...

    @overload
    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]: ...

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str | None] | None:
        """Vocabulary spelling of ids (byte-level tokens look like "Ġhello"); None for unknown ids."""
        if isinstance(ids, int):
            return self.backend.id_to_token(ids)
        return [self.backend.id_to_token(i) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    # ------------------------------------------------------------------ chat
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        *,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the conversation to a prompt string (not tokenized). ``chat_template`` is a
        template name or the template text itself; other keyword arguments reach the template."""
        template = select_chat_template(self.chat_templates, chat_template, has_tools=bool(tools))
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            special_tokens=self.special_tokens,
            tools=tools,
            documents=documents,
            **kwargs,
        )

    def __repr__(self) -> str:
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size})"


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_path(path)


# --- helpers -------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _register_config_tokens(backend: BackendTokenizer, config: Mapping[str, Any], specials: list[str]) -> None:
    """Add the tokens tokenizer_config.json declares but tokenizer.json lacks, and make the named
    special tokens special added tokens (matched whole, skipped when decoding)."""
    added = {tok.content: tok for tok in backend.get_added_tokens_decoder().values()}
    decoder = config.get("added_tokens_decoder") or {}
    missing: list[AddedToken] = []
    for entry in decoder.values() if isinstance(decoder, Mapping) else ():
        content = _token_content(entry)
        if content is None or content in added:
            continue
        missing.append(
            AddedToken(
                content,
                single_word=bool(entry.get("single_word", False)),
                lstrip=bool(entry.get("lstrip", False)),
                rstrip=bool(entry.get("rstrip", False)),
                normalized=bool(entry.get("normalized", not entry.get("special", False))),
                special=bool(entry.get("special", False)),
            )
        )
    for token in missing:
        if token.special:
            backend.add_special_tokens([token])
        else:
            backend.add_tokens([token])
    promote = [
        AddedToken(c, special=True, normalized=False)
        for c in dict.fromkeys(specials)
        if c not in added and c not in {t.content for t in missing}
    ]
    if promote:
        backend.add_special_tokens(promote)


def _hf_chat_templates(path: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Chat templates of an HF directory: tokenizer_config.json's chat_template (a string or a
    list of {name, template}), overridden by chat_template.json / chat_template.jinja, plus
    additional_chat_templates/<name>.jinja."""
    templates: dict[str, str] = {}
    value = config.get("chat_template")
    if isinstance(value, str):
        templates["default"] = value
    elif isinstance(value, list):
        for item in value:
            if isinstance(item, Mapping) and isinstance(item.get("name"), str):
                templates[item["name"]] = str(item.get("template", ""))
    json_template = _read_json(path / "chat_template.json").get("chat_template")
    if isinstance(json_template, str):
        templates["default"] = json_template
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra_dir = path / "additional_chat_templates"
    if extra_dir.is_dir():
        for file in sorted(extra_dir.glob("*.jinja")):
            templates[file.stem] = file.read_text(encoding="utf-8")
    return templates
