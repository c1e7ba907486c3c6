"""The GGUF tokenizer of the embedded SmolLM2-135M-Instruct against transformers' GGUF loader.

Our tokenizer must reproduce the original Hugging Face SmolLM2 tokenizer, whose tokenizer.json
pre-tokenizer is Sequence[Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
use_regex=True)] (llama.cpp calls this flavour "smollm"). transformers' GGUF conversion does not
know the "smollm" flavour and falls back to the plain GPT-2 ByteLevel split, which differs on one
pattern only; see KNOWN_DIFFERENT below.
"""

from __future__ import annotations

import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import pre_tokenizers

from vllm_actors.actors.frontend.chat_template import MissingChatTemplateError
from vllm_actors.actors.frontend.gguf_tokenizer import GGUFTokenType, load_gguf_tokenizer, tokenizer_from_gguf_metadata
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer

# Hand-picked strings: every one must encode exactly as transformers does.
SAME_STRINGS = [
    "",
    "Hello world",
    "Hello, World!",
    " leading space",
    "trailing space ",
    "multiple   internal    spaces",
    "tabs\tand\nnewlines\r\nmixed",
    "\n",
    "\n\n\n",
    "   ",
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'd go.",
    "Numbers 12345 and 3.14159 and 1,000,000",
    "12345678901234567890",
    "phone: +1 (555) 123-4567",
    "2024-06-01T12:34:56Z",
    "0.1 + 0.2 = 0.30000000000000004",
    "x1y22z333",
    "1st 2nd 3rd 4th",
    "Café naïve résumé façade Ångström",
    "e\u0301 combining acute",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ",
    "한국어 텍스트입니다",
    "Россия и Україна",
    "مرحبا بالعالم",
    "Emoji: 😀👍🏽🇺🇸 and ❤️",
    "👨‍👩‍👧‍👦 family",
    "superscripts²³, fractions½¾ (no space before them)",
    "zero\u200bwidth and\u00a0nbsp",
    "def foo(x):\n    return x ** 2  # comment\n",
    "for (int i = 0; i < n; i++) { sum += a[i]; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    '<div class="x">&amp;</div>',
    "SELECT * FROM users WHERE id = 42;",
    "```python\nprint('hi')\n```",
    "$$\\int_0^1 x^2 dx = \\frac{1}{3}$$",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>",
    "<|endoftext|>",
    "text<|im_end|>more<|im_start|>",
    "<|im_start",
    "im_end|>",
    "<repo_name>foo<file_sep>bar<filename>baz.py",
    "<jupyter_code>x = 1<jupyter_output>1<empty_output>",
    "a" * 300,
    "ab " * 50,
    "!!!??? ... --- (parens) [brackets] {braces}",
    "\u3000ideographic space",
    "\ufeffBOM at start",
    "mixed\u2028line\u2029separators",
]

# Strings where transformers' GGUF tokenizer differs from the original SmolLM2 tokenizer (and so
# from ours). The original splits every number character off first; transformers' GPT-2 split does
# not, which shows where whitespace directly precedes a number character:
#  (a) a run of two or more whitespace characters before a number: the original keeps the run as
#      one piece ("ĠĠ", "ĊĊ", "čĊ"...), while the GPT-2 pattern gives the run's last space to the
#      number (" ?\p{N}+") or ends the run one character early ("\s+(?!\S)"), cutting it into
#      smaller tokens;
#  (b) one space before a non-ASCII number character (² ½ Ⅻ ٣ ①...): the GPT-2 pattern makes
#      " ²" one piece and merges the space with the character's first byte ("ĠÂ" "²"), where the
#      original has "Ġ" "Â²". (ASCII digits never merge with a space in this vocabulary.)
# Value: our ids, which are the original tokenizer's.
KNOWN_DIFFERENT: dict[str, list[int]] = {
    "Total:  42": [17647, 42, 256, 36, 34],
    "\n\n1. First item": [1116, 33, 30, 3508, 5033],
    "x\r\n2": [104, 2738, 34],
    "a    7": [81, 289, 39],
    "\t\t3": [1656, 35],
    "Version   2.0": [22348, 333, 34, 30, 32],
    "line\n\n\n2024": [1311, 16506, 34, 32, 34, 36],
    "  1": [256, 33],
    "x \u00a01": [104, 3351, 250, 33],
    "  ²": [256, 19133],
    "x ²": [104, 216, 19133],
    "a ½ cup": [81, 216, 16738, 7118],
    "chapter Ⅻ": [42895, 216, 173, 223, 121],
    "100 ٣": [33, 32, 32, 216, 164, 113],
    "x ①": [104, 216, 173, 235, 250],
}

PIECES = [
    "hello", " world", "The", " the", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "123", "4", " 56", "3.14159",
    "1,000,000", "你好", "世界", "😀", "👍🏽", "🇺🇸", "café", "naïve", "Ångström", "e\u0301", "Привет", "مرحبا",
    "한국어", "²", "½", "Ⅻ", "٣", "def f(x):", "    return x**2", "{", "}", "<|im_start|>", "<|im_end|>",
    "<|endoftext|>", "user", "assistant", "'s", "'ll", "don't", "$", "%", "#", "//", "...", "!!!", "x",
    "\u00a0", "\u3000", "<repo_name>", "<|im_start", "im_end|>", "<", "|", "😀😀", "é", "ß", "ﬁ",
]


def _random_strings(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(1, 8))) for _ in range(count)]


RANDOM_STRINGS = _random_strings(400, seed=20240601)


def _whitespace_before_number(text: str) -> bool:
    return any(
        unicodedata.category(text[i]).startswith("N") and text[i - 1].isspace() for i in range(1, len(text))
    )


@pytest.fixture(scope="module")
def ours(default_gguf_path: str) -> Tokenizer:
    return load_tokenizer(default_gguf_path)


@pytest.fixture(scope="module")
def hf(default_gguf_path: str) -> Any:
    transformers = pytest.importorskip("transformers")
    path = Path(default_gguf_path)
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module")
def original(hf: Any) -> BackendTokenizer:
    """transformers' vocabulary and merges with the original SmolLM2 tokenizer.json pre-tokenizer."""
    backend = BackendTokenizer.from_str(hf.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


def test_metadata(ours: Tokenizer, hf: Any) -> None:
    assert ours.vocab_size == len(hf) == 49152
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (hf.bos_token_id, hf.eos_token_id, 2)
    assert (ours.bos_token, ours.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert ours.add_bos_token is False
    # All 17 control tokens of the file are special (transformers lists only the named ones in
    # all_special_ids, but skips all 17 when decoding, as we do).
    assert ours.all_special_ids == set(range(17))
    assert set(hf.all_special_ids) <= ours.all_special_ids
    ids = list(range(0, 49152, 97))
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(5) == "<file_sep>"


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_encode_matches_transformers_on_handpicked_strings(ours: Tokenizer, hf: Any, add_special_tokens: bool) -> None:
    for text in SAME_STRINGS:
        assert ours.encode(text, add_special_tokens) == hf.encode(text, add_special_tokens=add_special_tokens), text


def test_encode_matches_transformers_on_random_strings(ours: Tokenizer, hf: Any, original: BackendTokenizer) -> None:
    ours_ids = ours.encode_batch(RANDOM_STRINGS)
    differing = []
    for text, ids in zip(RANDOM_STRINGS, ours_ids, strict=True):
        assert ids == ours.encode(text)
        assert ids == original.encode(text).ids, text
        if ids != hf.encode(text):
            differing.append(text)
    # Every difference is the documented one; and it still exists (if transformers learns the
    # "smollm" pre-tokenizer, this fails: drop KNOWN_DIFFERENT then).
    assert all(_whitespace_before_number(t) for t in differing), differing[:5]
    assert len(differing) > 10
    assert len(differing) < len(RANDOM_STRINGS) // 3


def test_known_differences_from_transformers_gguf(ours: Tokenizer, hf: Any, original: BackendTokenizer) -> None:
    for text, expected in KNOWN_DIFFERENT.items():
        assert _whitespace_before_number(text)
        assert ours.encode(text) == expected, text
        assert original.encode(text).ids == expected, text
        assert hf.encode(text) != expected, f"transformers now agrees on {text!r}: drop it from KNOWN_DIFFERENT"
        assert ours.decode(expected) == text


def test_roundtrip_and_decode_matches_transformers(ours: Tokenizer, hf: Any) -> None:
    for text in SAME_STRINGS + RANDOM_STRINGS:
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(49152) for _ in range(rng.randint(1, 16))]
        ids += [rng.randrange(17) for _ in range(rng.randint(0, 2))]  # some control tokens
        rng.shuffle(ids)
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), ids


CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 × 3? 你好 😀\n\nBye"},
    ],
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(ours: Tokenizer, hf: Any, add_generation_prompt: bool) -> None:
    assert ours.chat_template == hf.chat_template
    for messages in CONVERSATIONS:
        expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
        assert got == expected
        assert ours.encode(got) == hf.encode(expected)
    assert ours.apply_chat_template(CONVERSATIONS[0]).endswith("<|im_start|>assistant\n")


def test_load_gguf_tokenizer_fields(default_gguf_path: str) -> None:
    loaded = load_gguf_tokenizer(default_gguf_path)
    assert loaded.backend.token_to_id("<|im_end|>") == 2
    assert set(loaded.chat_templates) == {"default"}


# --- synthetic metadata ---------------------------------------------------------------------------


def _tiny_metadata(**overrides: Any) -> dict[str, Any]:
    tokens = ["<|end|>", "<think>", "a", "b", "ab", "Ġ", "Ġab", "1", "2"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [
            GGUFTokenType.CONTROL, GGUFTokenType.USER_DEFINED, *([GGUFTokenType.NORMAL] * (len(tokens) - 2))
        ],
        "tokenizer.ggml.merges": ["a b", "Ġ ab"],
        "tokenizer.ggml.eos_token_id": 0,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }
    meta.update(overrides)
    return meta


def test_synthetic_metadata_tokens_and_flags() -> None:
    gguf = tokenizer_from_gguf_metadata(_tiny_metadata())
    tok = Tokenizer(
        gguf.backend,
        special_tokens={"bos_token": gguf.token(gguf.bos_token_id), "eos_token": gguf.token(gguf.eos_token_id)},
        add_bos_token=gguf.add_bos_token,
        add_eos_token=gguf.add_eos_token,
        chat_templates=gguf.chat_templates,
    )
    assert tok.encode("ab ab<think>12<|end|>") == [0, 4, 6, 1, 7, 8, 0]
    assert tok.encode("ab", add_special_tokens=False) == [4]
    assert tok.decode([0, 4, 6, 1, 0]) == "ab ab<think>"  # user-defined tokens are not special
    assert tok.all_special_ids == {0}
    with pytest.raises(MissingChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_named_chat_templates_in_metadata() -> None:
    gguf = tokenizer_from_gguf_metadata(
        _tiny_metadata(
            **{
                "tokenizer.chat_template": "D{{ messages[0].content }}",
                "tokenizer.chat_templates": ["tool_use"],
                "tokenizer.chat_template.tool_use": "T{{ tools | length }}",
            }
        )
    )
    tok = Tokenizer(gguf.backend, chat_templates=gguf.chat_templates)
    messages = [{"role": "user", "content": "x"}]
    assert tok.apply_chat_template(messages) == "Dx"
    assert tok.apply_chat_template(messages, tools=[{"name": "f"}]) == "T1"
    assert tok.apply_chat_template(messages, chat_template="tool_use", tools=[]) == "T0"


def test_unsupported_tokenizer_models() -> None:
    with pytest.raises(NotImplementedError, match="sentencepiece"):
        tokenizer_from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(NotImplementedError, match="'bert'"):
        tokenizer_from_gguf_metadata(_tiny_metadata(**{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="no tokenizer"):
        tokenizer_from_gguf_metadata({})
