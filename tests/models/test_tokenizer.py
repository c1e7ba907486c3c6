"""Hugging Face directory tokenizers (built on the spot) against transformers' AutoTokenizer, and
the chat template renderer."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from vllm_actors.actors.frontend.chat_template import ChatTemplateError, MissingChatTemplateError, render_chat_template
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Exercises trim_blocks/lstrip_blocks, loop controls, tojson (non-ASCII, no HTML escaping),
# raise_exception, bos/eos variables and extra keyword arguments.
FANCY = """{{ bos_token }}
{%- if tools %}
  {% for tool in tools %}
TOOL {{ tool | tojson }}
  {% endfor %}
{% endif %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role ' + message['role']) }}
    {% endif %}
    {% if message['role'] == 'system' and not loop.first %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] | trim }}
{%- if message['role'] == 'assistant' %}{% generation %}{{ eos_token }}{% endgeneration %}{% endif %}<|im_end|>
{% endfor %}
{% if documents is not none %}DOCS {{ documents | length }}
{% endif %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think></think>
{% endif %}
{% endif %}"""

CORPUS = [
    "Hello world! This is a tiny corpus for a tiny byte-level BPE tokenizer.",
    "Numbers like 12345 and 3.14159 appear, plus   runs of   spaces and\ttabs\nand newlines.",
    "Unicode: café naïve 你好世界 😀👍🏽 Привет мир مرحبا",
    "def f(x):\n    return x ** 2  # code\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>",
] * 20

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

TEXTS = [
    "",
    "Hello world",
    " Hello   world  ",
    "tabs\tand\nnewlines\r\n",
    "12345 3.14159",
    "café naïve 你好世界 😀👍🏽 Привет",
    "unseen: ÆØÅ ß 日本語 🦀",
    "<|im_start|>user\nhi<|im_end|>",
    "a<|endoftext|>b",
    "def f(x):\n    return x ** 2",
]

CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? 你好"}],
    [
        {"role": "user", "content": "  padded  "},
        {"role": "assistant", "content": "ok"},
        {"role": "system", "content": "late system"},
        {"role": "user", "content": "again"},
    ],
]
TOOLS = [{"name": "lookup", "description": "Look <things> & \"stuff\" up — ünïcödé", "parameters": {"q": "str"}}]


def _train_backend() -> BackendTokenizer:
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return backend


def _write_dir(path: Path, config: dict[str, Any], *, jinja: str | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    _train_backend().save(str(path / "tokenizer.json"))
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 2048}
    (path / "tokenizer_config.json").write_text(json.dumps({**base, **config}), encoding="utf-8")
    if jinja is not None:
        (path / "chat_template.jinja").write_text(jinja, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_dir(
        tmp_path_factory.mktemp("chatml"),
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML},
    )


@pytest.fixture(scope="module")
def bos_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_dir(
        tmp_path_factory.mktemp("bos"),
        {
            "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True, "normalized": False},
            "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
            "add_bos_token": True,
            "chat_template": [
                {"name": "default", "template": FANCY},
                {"name": "tool_use", "template": "TOOLS{{ tools|length }}"},
            ],
        },
    )


@pytest.fixture(scope="module")
def transformers() -> Any:
    return pytest.importorskip("transformers")


def _pair(path: Path, transformers: Any) -> tuple[Tokenizer, Any]:
    return load_tokenizer(str(path)), transformers.AutoTokenizer.from_pretrained(str(path))


def test_chatml_dir_matches_transformers(chatml_dir: Path, transformers: Any) -> None:
    ours, hf = _pair(chatml_dir, transformers)
    assert ours.eos_token_id == hf.eos_token_id == 2
    assert ours.bos_token_id is None and hf.bos_token_id is None
    assert ours.vocab_size == len(hf)
    # Every special added token counts (transformers 5 lists only the named and "extra" ones).
    assert set(hf.all_special_ids) <= ours.all_special_ids == {0, 1, 2}
    for text in TEXTS:
        for add in (True, False):
            ids = ours.encode(text, add_special_tokens=add)
            assert ids == hf.encode(text, add_special_tokens=add), text
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
        assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.decode(ours.encode("<|im_start|>x<|im_end|>"), skip_special_tokens=True) == "x"
    for messages in CONVERSATIONS:
        for gen in (True, False):
            expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == expected


def test_bos_and_template_list_match_transformers(bos_dir: Path, transformers: Any) -> None:
    ours, hf = _pair(bos_dir, transformers)
    assert ours.add_bos_token
    assert ours.bos_token_id == hf.bos_token_id == 1
    for text in TEXTS:
        # Documented difference: transformers 5 drops tokenizer_config.json's add_bos_token when
        # a tokenizer.json exists (its post-processor decides); we honour the flag, as llama.cpp
        # and transformers 4 do, since the model was trained with that BOS.
        assert ours.encode(text) == [1, *hf.encode(text)], text
        assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
        assert ours.encode_batch([text, text]) == [ours.encode(text)] * 2
    assert ours.chat_template == FANCY
    for messages in CONVERSATIONS:
        for gen in (True, False):
            for extra in ({}, {"enable_thinking": False}, {"tools": TOOLS}, {"documents": [{"text": "d"}]}):
                expected = hf.apply_chat_template(
                    messages, tokenize=False, add_generation_prompt=gen, chat_template=FANCY, **extra
                )
                got = ours.apply_chat_template(messages, add_generation_prompt=gen, chat_template=FANCY, **extra)
                assert got == expected, extra
    rendered = ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS, chat_template="default")
    assert '"description": "Look <things> & \\"stuff\\" up — ünïcödé"' in rendered
    assert ours.apply_chat_template(CONVERSATIONS[0], tools=TOOLS) == "TOOLS1"  # tool_use template picked
    assert ours.apply_chat_template(CONVERSATIONS[0]).startswith("<|im_start|><|im_start|>user\nHi!<|im_end|>\n")


def test_post_processor_bos_is_not_doubled(tmp_path: Path, transformers: Any) -> None:
    path = _write_dir(tmp_path / "tp", {"bos_token": "<|im_start|>", "add_bos_token": True, "eos_token": "<|im_end|>"})
    backend = BackendTokenizer.from_file(str(path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B:1", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(path / "tokenizer.json"))
    ours, hf = _pair(path, transformers)
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text) == [1, *ours.encode(text, add_special_tokens=False)]
    # add_eos_token on top of a post-processor that adds BOS keeps the BOS.
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "add_eos_token": True}))
    tok = load_tokenizer(str(path))
    assert tok.encode("Hello") == [1, *tok.encode("Hello", add_special_tokens=False), 2]
    assert (tok.add_bos_token, tok.add_eos_token) == (True, True)


def test_raise_exception_in_template(bos_dir: Path, transformers: Any) -> None:
    ours, hf = _pair(bos_dir, transformers)
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(ChatTemplateError, match="unknown role tool"):
        ours.apply_chat_template(bad)
    with pytest.raises(Exception, match="unknown role tool"):
        hf.apply_chat_template(bad, tokenize=False, chat_template=FANCY)
    assert issubclass(ChatTemplateError, ValueError)


def test_separate_jinja_file_wins(tmp_path: Path) -> None:
    config = {"eos_token": "<|im_end|>", "chat_template": "from config"}
    path = _write_dir(tmp_path / "jinja", config, jinja="from file {{ eos_token }}")
    tok = load_tokenizer(str(path))
    assert tok.apply_chat_template([]) == "from file <|im_end|>"
    assert load_tokenizer(str(path / "tokenizer.json")).chat_template == "from file {{ eos_token }}"


def test_special_tokens_map(tmp_path: Path, transformers: Any) -> None:
    path = _write_dir(tmp_path / "map", {"chat_template": CHATML})
    special_map = {"eos_token": {"content": "<|im_end|>", "special": True}, "bos_token": "<|im_start|>"}
    (path / "special_tokens_map.json").write_text(json.dumps(special_map), encoding="utf-8")
    ours, hf = _pair(path, transformers)
    assert (ours.bos_token_id, ours.eos_token_id) == (hf.bos_token_id, hf.eos_token_id) == (1, 2)
    assert ours.add_bos_token is False
    for text in TEXTS:
        assert ours.encode(text) == hf.encode(text)


def test_missing_chat_template(tmp_path: Path, transformers: Any) -> None:
    path = _write_dir(tmp_path / "none", {"eos_token": "<|im_end|>"})
    ours, hf = _pair(path, transformers)
    assert ours.chat_template is None
    with pytest.raises(MissingChatTemplateError, match="no chat template") as info:
        ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(info.value, ValueError)
    with pytest.raises(ValueError):
        hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    # An explicit template still works.
    assert ours.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=CHATML).endswith(
        "<|im_start|>assistant\n"
    )


def test_template_errors_and_sandbox() -> None:
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])
    with pytest.raises(ChatTemplateError):  # the sandbox refuses attribute tricks
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError):  # immutable sandbox: no in-place mutation of messages
        render_chat_template("{{ messages.append(1) }}", [])


def test_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match=r"no tokenizer\.json"):
        load_tokenizer(str(tmp_path))
    other = tmp_path / "x.txt"
    other.write_text("hi")
    with pytest.raises(ValueError, match="not a GGUF"):
        load_tokenizer(str(other))


def test_text_layer_does_not_import_torch_or_transformers(chatml_dir: Path, default_gguf_path: str) -> None:
    code = (
        "import sys\n"
        "from vllm_actors.actors.frontend.tokenizer import load_tokenizer\n"
        "from vllm_actors.actors.frontend.detokenizer import IncrementalDetokenizer\n"
        f"for path in ({str(chatml_dir)!r}, {default_gguf_path!r}):\n"
        "    tok = load_tokenizer(path)\n"
        "    d = IncrementalDetokenizer(tok, tok.encode('hi'), stop=['x'])\n"
        "    d.add_tokens(tok.encode('hello world'))\n"
        "    tok.apply_chat_template([{'role': 'user', 'content': 'hi'}])\n"
        "bad = sorted(m for m in ('torch', 'transformers') if m in sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
