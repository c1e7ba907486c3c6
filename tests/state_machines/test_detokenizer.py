"""Incremental detokenization: streamed deltas add up to the full decode; stop strings."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from vllm_actors.actors.frontend.detokenizer import IncrementalDetokenizer
from vllm_actors.actors.frontend.tokenizer import Tokenizer, load_tokenizer

UNICODE_TEXTS = [
    "Hello world! 12345 and 3.14159.",
    "你好，世界！这是一个测试。日本語のテキスト。한국어 텍스트",
    "Emoji: 😀👍🏽🇺🇸 👨‍👩‍👧‍👦 ❤️ and 🦀🐍",
    "Café naïve résumé e\u0301 Ångström Привет мир مرحبا بالعالم",
    "def f(x):\n    return x ** 2  # ünïcödé\n\n\tdone",
    "<|im_start|>assistant\nSure!<|im_end|> trailing",
]


@pytest.fixture(scope="module")
def tok(default_gguf_path: str) -> Tokenizer:
    return load_tokenizer(default_gguf_path)


def _stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], rng: random.Random | None = None, *, finish: bool = True
) -> list[str]:
    """Feed ids in chunks (of 1 token, or random sizes 1..4); return the deltas (with finish())."""
    deltas: list[str] = []
    i = 0
    while i < len(ids):
        size = 1 if rng is None else rng.randint(1, 4)
        update = detok.add_tokens(ids[i : i + size])
        deltas.append(update.text)
        i += size
        if update.stopped:
            break
    if finish:
        deltas.append(detok.finish())
    return deltas


def test_text_streams_without_replacement_characters(tok: Tokenizer) -> None:
    prompt = tok.encode("Say something:")
    for text in UNICODE_TEXTS:
        ids = tok.encode(text)
        for skip in (True, False):
            detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
            deltas = _stream(detok, ids, finish=False)
            assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
            assert all("\ufffd" not in d for d in deltas)  # incomplete characters were held back
            assert detok.output_text == "".join(deltas)
            assert detok.finish() == ""
    # Multi-byte characters split over several tokens: some steps yield nothing.
    ids = tok.encode("🦀")
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tok, [])
    assert [detok.add_tokens([i]).text for i in ids] == [""] * (len(ids) - 1) + ["🦀"]


def test_random_ids_concatenate_to_full_decode(tok: Tokenizer) -> None:
    rng = random.Random(1234)
    multibyte = tok.encode("".join(UNICODE_TEXTS), add_special_tokens=False)
    byte_tokens = [i for i in range(tok.vocab_size) if len(tok.convert_ids_to_tokens(i) or "") == 1]
    prompts = [[], tok.encode("Once upon a time"), tok.encode("é"), [1, 9690, 198]]
    for case in range(400):
        pool = rng.choice([multibyte, byte_tokens, range(tok.vocab_size)])
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 40))]
        if case % 5 == 0:
            ids.insert(rng.randrange(len(ids) + 1), rng.randrange(17))  # a control token
        skip = case % 2 == 0
        detok = IncrementalDetokenizer(tok, rng.choice(prompts), skip_special_tokens=skip)
        deltas = _stream(detok, ids, rng)
        assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip), ids
        assert detok.output_text == "".join(deltas)
        assert detok.token_ids == ids
        # Deltas carry U+FFFD only where the full text has one for good.
        assert "".join(deltas).count("\ufffd") == tok.decode(ids, skip_special_tokens=skip).count("\ufffd")


def test_prompt_ending_inside_a_character(tok: Tokenizer) -> None:
    ids = tok.encode("😀")
    prompt, output = ids[:1], ids[1:]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = _stream(detok, output)
    # The first output tokens are not glued to the prompt's dangling bytes.
    assert "".join(deltas) == tok.decode(output)


def test_stop_string_across_token_boundaries(tok: Tokenizer) -> None:
    text = "The quick brown fox says STOP_HERE and more text follows."
    ids = tok.encode(text)
    assert len(tok.encode("STOP_HERE")) > 2
    for include in (False, True):
        detok = IncrementalDetokenizer(
            tok, tok.encode("prompt"), stop=["STOP_HERE"], include_stop_str_in_output=include
        )
        expected = "The quick brown fox says " + ("STOP_HERE" if include else "")
        streamed = ""
        used = 0
        for i in ids:
            update = detok.add_tokens([i])
            used += 1
            streamed += update.text
            assert expected.startswith(streamed)  # nothing streamed is ever taken back
            if not include:
                assert "STOP" not in streamed and not streamed.endswith(" S")
            if update.stopped:
                assert update.stop_reason == "STOP_HERE"
                break
        assert streamed == detok.output_text == expected
        assert tok.decode(detok.token_ids).endswith("STOP_HERE")  # the stopping token is the last one kept
        assert len(detok.token_ids) == used < len(ids)
        assert detok.finish() == ""
        after = detok.add_tokens(ids[used:])
        assert (after.text, after.stopped, after.num_tokens) == ("", True, 0)


def test_stop_in_a_batch_reports_tokens_used(tok: Tokenizer) -> None:
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, [], stop=["gamma"])
    update = detok.add_tokens(ids)
    assert (update.text, update.stopped, update.stop_reason) == ("alpha beta ", True, "gamma")
    assert update.num_tokens == len(detok.token_ids) == len(tok.encode("alpha beta gamma"))


def test_held_back_text_is_released_or_flushed(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["xyz!"])
    first = detok.add_tokens(tok.encode("abc x"))
    assert first.text == "abc "  # "x" could begin "xyz!"
    assert detok.add_tokens(tok.encode("y")).text == ""  # "xy" still could
    assert detok.add_tokens(tok.encode("q")).text == "xyq"  # now it cannot
    assert detok.add_tokens(tok.encode(" xyz")).text == " "
    assert detok.finish() == "xyz"  # finished by other means (length, EOS): flush
    assert detok.output_text == "abc xyq xyz"
    assert not detok.stopped


def test_earliest_of_several_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four")
    for stops in (["four", "two"], ["two", "four"], ["wo t", "three"]):
        detok = IncrementalDetokenizer(tok, [], stop=stops)
        update = detok.add_tokens(ids)
        assert update.stopped
        assert detok.output_text == "one t" if "wo t" in stops else "one "
    detok = IncrementalDetokenizer(tok, [], stop=["", "zzz"])  # empty stop strings are ignored
    assert "".join(_stream(detok, ids)) == "one two three four"


def test_min_tokens_delays_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode("stop early, then stop again, final")
    first_stop_tokens = len(tok.encode("stop"))
    detok = IncrementalDetokenizer(tok, [], stop=["stop"], min_tokens=first_stop_tokens)
    assert "".join(_stream(detok, ids)) == ""  # reached min_tokens exactly on the stop string
    detok = IncrementalDetokenizer(tok, [], stop=["stop"], min_tokens=first_stop_tokens + 1)
    out = "".join(_stream(detok, ids))
    assert out == "stop early, then "
    assert detok.stopped and detok.stop_reason == "stop"
    detok = IncrementalDetokenizer(tok, [], stop=["stop"], min_tokens=len(ids) + 5)
    assert "".join(_stream(detok, ids)) == tok.decode(ids)
    assert not detok.stopped


def test_unicode_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode("你好世界！再见😀世界")
    for include, expected in ((False, "你好"), (True, "你好世界")):
        detok = IncrementalDetokenizer(tok, [], stop=["世界"], include_stop_str_in_output=include)
        deltas = _stream(detok, ids)
        assert "".join(deltas) == expected
        assert all("\ufffd" not in d for d in deltas)
    detok = IncrementalDetokenizer(tok, [], stop=["😀"])
    assert "".join(_stream(detok, ids)) == "你好世界！再见"


def test_random_stop_strings_match_reference(tok: Tokenizer) -> None:
    rng = random.Random(99)
    words = ["alpha", " beta", " 12", "3", " 你好", "😀", "\n", "!", " end", " ünï", "  ", "<|im_end|>"]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(2, 12)))
        ids = tok.encode(text)
        full = tok.decode(ids)
        if not full:
            continue
        start = rng.randrange(len(full))
        stop = full[start : start + rng.randint(1, 6)]
        include = rng.random() < 0.5
        detok = IncrementalDetokenizer(tok, [], stop=[stop], include_stop_str_in_output=include)
        deltas = _stream(detok, ids, rng)
        index = full.find(stop)
        expected = full[: index + len(stop)] if include else full[:index]
        assert "".join(deltas) == detok.output_text == expected, (text, stop)
        assert detok.stopped and detok.stop_reason == stop


def test_metaspace_tokenizer_keeps_the_leading_space_after_the_prompt() -> None:
    """Sentencepiece-style decoders drop the leading space of a decode call's first token; the
    prompt context keeps the space that separates the output from the prompt."""
    backend = BackendTokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    backend.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "</s>"], show_progress=False)
    backend.train_from_iterator(["hello world and more words here"] * 10, trainer=trainer)
    tok = Tokenizer(backend, special_tokens={"eos_token": "</s>", "unk_token": "<unk>"})
    prompt, output = tok.encode("hello"), tok.encode("world and more")
    assert tok.decode(output) == "world and more"
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(_stream(detok, output)) == " world and more"
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(_stream(detok, output)) == "world and more"
