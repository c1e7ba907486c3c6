"""vLLM's sampling controls (penalties, logit_bias, allowed_token_ids, bad words)
in the batched sampler, against a float64 reference of vLLM's formulas on the tiny model's logits,
and end to end through ``LLM``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_actors import LLM, SamplingParams
from vllm_actors.actors.frontend.controls import bad_words_token_ids
from vllm_actors.actors.frontend.tokenizer import load_tokenizer
from vllm_actors.actors.worker.step_data import SamplingRow
from vllm_actors.kernels import penalties as penalty_kernel
from vllm_actors.kernels import sampling as fused_sampling
from vllm_actors.runner.penalties import apply_controls, banned_by_bad_words
from vllm_actors.runner.sampler import Sampler

PROMPT = [5, 17, 17, 99, 3, 42]
OUTPUT = [17, 7, 7, 7, 250, 3]


@pytest.fixture(scope="module")
def model_logits(tiny_qwen3: Path) -> torch.Tensor:
    """The tiny model's float32 logits at the last 6 positions of PROMPT + OUTPUT: [6, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + OUTPUT])).logits[0].float()
    return logits[-6:].contiguous() * 10.0  # spread out: near-zero logits would hide sign errors


def reference(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM v1's order and formulas, in float64, one token at a time."""
    row = logits.double().clone()
    vocab = row.shape[0]
    if params.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[params.allowed_token_ids] = True
        row[~keep] = float("-inf")
    for word in params.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output) and (not prefix or output[-len(prefix):] == prefix):
            row[word[-1]] = float("-inf")
    for token_id, bias in (params.logit_bias or {}).items():
        row[token_id] += max(-100.0, min(100.0, bias))
    for token_id in set(prompt) | set(output):
        value = row[token_id].item()
        row[token_id] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token_id in set(output):
        row[token_id] -= params.frequency_penalty * output.count(token_id) + params.presence_penalty
    return row


MIXED = [
    SamplingParams(temperature=0.0, repetition_penalty=1.7),
    SamplingParams(temperature=0.0),  # no controls
    SamplingParams(temperature=0.8, seed=11, presence_penalty=1.5, frequency_penalty=-0.7),
    SamplingParams(temperature=0.0, logit_bias={3: 250.0, 9: -4.0}, repetition_penalty=0.6),
    SamplingParams(seed=5, allowed_token_ids=[1, 7, 17, 300], frequency_penalty=2.0),
    SamplingParams(temperature=0.0, bad_words_token_ids=[[250, 3], [7], [9, 9]], presence_penalty=-2.0),
]


def rows_of(params: list[SamplingParams]) -> list[SamplingRow]:
    return [SamplingRow(p, len(OUTPUT), [], PROMPT + OUTPUT, len(PROMPT)) for p in params]


def test_controls_match_vllms_formulas_in_float64(model_logits: torch.Tensor) -> None:
    processed = apply_controls(model_logits, rows_of(MIXED))
    assert processed.dtype == torch.float32
    for index, params in enumerate(MIXED):
        expected = reference(model_logits[index], params, PROMPT, OUTPUT)
        actual = processed[index].double()
        finite = torch.isfinite(expected)
        assert torch.equal(finite, torch.isfinite(actual)), index
        torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=1e-4)
    assert torch.equal(processed[1], model_logits[1])  # the row without controls is untouched
    assert not torch.equal(processed[0], model_logits[0])


def test_rows_without_controls_cost_nothing(model_logits: torch.Tensor) -> None:
    plain = [SamplingParams(temperature=0.0), SamplingParams(seed=3)]
    logits = model_logits[:2]
    assert apply_controls(logits, rows_of(plain)) is logits  # no copy, no conversion


def test_the_draw_sees_the_controls_greedy_and_seeded(model_logits: torch.Tensor) -> None:
    """Each row's token is the one drawn from its reference-processed logits: greedy rows the
    argmax, seeded rows the same seed's draw (it depends on nothing else in the batch)."""
    chosen = Sampler(torch.device("cpu"))(model_logits, rows_of(MIXED)).token_ids
    for index, params in enumerate(MIXED):
        expected_logits = reference(model_logits[index], params, PROMPT, OUTPUT).float().unsqueeze(0)
        plain = SamplingParams(temperature=params.temperature, seed=params.seed)
        expected = Sampler(torch.device("cpu"))(expected_logits, rows_of([plain])).token_ids[0]
        assert chosen[index] == expected, index
    assert chosen[3] == 3  # forced by its +250 bias (clamped to +100)
    assert chosen[4] in (1, 7, 17, 300)


@pytest.mark.skipif(not fused_sampling.HAVE_TRITON, reason="triton is not installed")
def test_the_fused_kernel_sees_the_controls(model_logits: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused Triton path (rows without top-k/top-p/min-p; TRITON_INTERPRET=1 on the CPU) draws
    from the processed logits too."""
    monkeypatch.setenv("VLLM_ACTORS_SAMPLER", "triton")
    sampler = Sampler(torch.device("cpu"))
    assert sampler.fused
    chosen = sampler.draw(model_logits, rows_of(MIXED)).tolist()
    for index, params in enumerate(MIXED):
        expected_logits = reference(model_logits[index], params, PROMPT, OUTPUT).float().unsqueeze(0)
        plain = SamplingParams(temperature=params.temperature, seed=params.seed)
        assert chosen[index] == Sampler(torch.device("cpu")).draw(expected_logits, rows_of([plain])).item(), index


def test_bad_words_ban_the_last_token_after_a_matching_prefix() -> None:
    words = [[1], [2, 3], [4, 5, 6], [9, 9, 9, 9]]
    assert banned_by_bad_words(words, []) == [1]
    assert banned_by_bad_words(words, [7, 2]) == [1, 3]
    assert banned_by_bad_words(words, [4, 5]) == [1, 6]
    assert banned_by_bad_words(words, [9, 9]) == [1]


def test_bad_words_are_tokenised_with_and_without_a_leading_space(tiny_qwen3: Path) -> None:
    tokenizer = load_tokenizer(tiny_qwen3)
    sequences = bad_words_token_ids(tokenizer, ["hello"])
    plain = tokenizer.encode("hello", add_special_tokens=False)
    spaced = tokenizer.encode(" hello", add_special_tokens=False)
    assert sequences[0] == plain
    assert (spaced in sequences) == (spaced[0] != plain[0] and len(spaced) == len(plain))


BAD = [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.1}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"),
    ({"logit_bias": {2**31: 1.0}}, "logit_bias"),
    ({"logit_bias": {1: float("nan")}}, "logit_bias"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [2**31]}, "allowed_token_ids"),
    ({"bad_words": "x"}, "bad_words"),
]


@pytest.mark.parametrize(("kwargs", "field"), BAD)
def test_invalid_controls_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.fixture(scope="module")
def llm(tiny_qwen3: Path):  # noqa: ANN201
    with LLM(str(tiny_qwen3), dtype="float32", max_num_batched_tokens=128, seed=0) as engine:
        yield engine


def test_controls_end_to_end_through_llm(llm: LLM) -> None:
    prompt = "The quick brown fox"
    plain_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    plain = llm.generate([prompt], plain_params)[0].outputs[0]
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={42: 100.0})
    allowed = SamplingParams(seed=1, max_tokens=12, ignore_eos=True, allowed_token_ids=[11, 12, 13])
    banned = plain.token_ids[:2]
    bad = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                         bad_words_token_ids=[[banned[0]], [banned[1]]])
    rewarded = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=0.05,
                              presence_penalty=-2.0, frequency_penalty=-2.0)
    outputs = llm.generate([prompt] * 5, [forced, allowed, bad, rewarded, plain_params])
    assert outputs[0].outputs[0].token_ids == [42] * 6
    assert set(outputs[1].outputs[0].token_ids) <= {11, 12, 13}
    assert not set(outputs[2].outputs[0].token_ids) & set(banned)
    assert len(set(plain.token_ids)) == 8 and len(set(outputs[3].outputs[0].token_ids)) < 8  # repeats
    assert outputs[4].outputs[0].token_ids == plain.token_ids  # the plain row in the same batch: unchanged


def test_only_bad_words_keep_a_step_from_being_deferred() -> None:
    """Bad words read the tokens so far on the host: such a step waits for the previous one's
    tokens. Penalties read the device's counts (PenaltyPool), logit_bias and allowed_token_ids
    nothing: those steps are launched before the previous one is read back."""
    assert Sampler.needs_host(SamplingParams(bad_words_token_ids=[[3]]))
    assert not Sampler.needs_host(SamplingParams(presence_penalty=0.5))
    assert not Sampler.needs_host(SamplingParams(repetition_penalty=1.1, frequency_penalty=0.3))
    assert not Sampler.needs_host(SamplingParams(logit_bias={1: 2.0}, allowed_token_ids=[1]))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_pooled_penalties_follow_the_draws_like_the_token_lists(model_logits: torch.Tensor, backend: str,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows with a PenaltyPool slot (written once from the prompt and a resumed request's outputs,
    then counted on the device after each draw) get the same logits as the float64 reference over
    their whole history, step after step; a slot freed and reused starts clean. ``triton``: the
    one-pass kernel (``kernels/penalties.py``, interpreted on the CPU)."""
    if backend == "triton" and not penalty_kernel.HAVE_TRITON:
        pytest.skip("triton is not installed")
    monkeypatch.setenv("VLLM_ACTORS_PENALTIES", backend)
    sampler = Sampler(torch.device("cpu"), seed=0)
    pool = sampler.penalties
    penalised = [p for p in MIXED if p.has_penalties]
    outputs = [list(OUTPUT) if index % 2 else [] for index in range(len(penalised))]  # some resumed
    slots = [pool.add(f"r{index}", PROMPT, outputs[index]) for index in range(len(penalised))]
    pool.remove("r0")  # dropped, then re-admitted into the freed slot with a history of its own
    outputs[0] = [250, 250]
    slots[0] = pool.add("r0", PROMPT, outputs[0])
    for step in range(6):
        logits = model_logits[: len(penalised)].roll(step, dims=1).contiguous()
        rows = [SamplingRow(p, len(outputs[i]), [], (), len(PROMPT), slots[i]) for i, p in enumerate(penalised)]
        processed = apply_controls(logits, rows, pool)
        for index, params in enumerate(penalised):
            expected = reference(logits[index], params, PROMPT, outputs[index])
            finite = torch.isfinite(expected)
            torch.testing.assert_close(processed[index].double()[finite], expected[finite], rtol=1e-6, atol=1e-4)
        chosen = sampler.draw(logits, rows)
        for index, token in enumerate(chosen.tolist()):
            outputs[index].append(token)
    assert len(pool) == len(penalised)
    pool.clear()
    assert len(pool) == 0


@pytest.mark.skipif(not penalty_kernel.HAVE_TRITON, reason="triton is not installed")
def test_the_penalties_kernel_against_torch_in_float64() -> None:
    """Scattered rows and slots, logits of both signs, counts and prompt flags of every kind: the
    kernel's float32 result against the formula in float64."""
    generator = torch.Generator().manual_seed(3)
    vocab, num_slots = 5000, 7  # vocabulary not a multiple of the kernel's block
    logits = torch.randn((9, vocab), generator=generator) * 5
    prompt_seen = torch.rand((num_slots, vocab), generator=generator) < 0.1
    output_counts = (torch.rand((num_slots, vocab), generator=generator) < 0.05).float() * torch.randint(
        1, 4, (num_slots, vocab), generator=generator)
    rows, slots = torch.tensor([8, 0, 3, 5]), torch.tensor([2, 6, 0, 2])
    scalars = torch.tensor([[1.3, 0.7, 1.0, 2.0], [0.5, -0.4, 0.0, 1.0], [0.25, 1.5, -1.0, 0.0]])
    expected = logits.double().clone()
    for i, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist(), strict=True)):
        x, counts = expected[row], output_counts[slot].double()
        generated = counts > 0
        penalty = torch.where(prompt_seen[slot] | generated, scalars[0, i].double(), torch.tensor(1.0).double())
        x = torch.where(x > 0, x / penalty, x * penalty)
        expected[row] = x - scalars[1, i].double() * counts - scalars[2, i].double() * generated.double()
    for apply in (penalty_kernel.apply_penalties, penalty_kernel.apply_penalties_torch):
        result = logits.clone()
        apply(result, rows, slots, prompt_seen, output_counts, scalars)
        torch.testing.assert_close(result.double(), expected, rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="float32"):
        penalty_kernel.apply_penalties(logits.double(), rows, slots, prompt_seen, output_counts, scalars)


def test_bad_word_strings_never_appear(llm: LLM, tiny_qwen3: Path) -> None:
    """A word the greedy output contains, given as a string: its token sequences (the frontend
    tokenises it) never appear in the output."""
    tokenizer = load_tokenizer(tiny_qwen3)
    prompt = "The quick brown fox"
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    word = next(text for text in (tokenizer.decode([t]) for t in plain.token_ids)
                if text.strip().isalpha() and tokenizer.encode(text.strip(), add_special_tokens=False))
    sequences = bad_words_token_ids(tokenizer, [word])
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                bad_words=[word]))[0].outputs[0]
    ids = out.token_ids
    for sequence in sequences:
        assert not any(ids[i:i + len(sequence)] == sequence for i in range(len(ids))), (word, sequence, ids)
    assert ids != plain.token_ids


def test_out_of_vocabulary_ids_are_refused(llm: LLM) -> None:
    for kwargs, field in (({"logit_bias": {10**6: 1.0}}, "logit_bias"),
                          ({"allowed_token_ids": [10**6]}, "allowed_token_ids")):
        with pytest.raises(ValueError, match=field):
            llm.generate(["hi"], SamplingParams(max_tokens=1, **kwargs))


def test_greedy_penalised_generation_matches_the_reference_step_by_step(llm: LLM, tiny_qwen3: Path) -> None:
    """Through the engine (async scheduling on: penalised steps are deferred, their counts kept on
    the device), greedy outputs equal a loop over transformers' float32 logits with vLLM's penalty
    formulas applied to the whole history."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), dtype=torch.float32)
    model.eval()
    cases = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.8,
                            presence_penalty=0.9, frequency_penalty=0.6),
             SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=0.2,
                            frequency_penalty=-1.5)]
    outputs = llm.generate([{"prompt_token_ids": PROMPT}] * len(cases), cases)
    for params, output in zip(cases, outputs, strict=True):
        generated: list[int] = []
        with torch.no_grad():
            for _ in range(params.max_tokens or 0):
                logits = model(torch.tensor([PROMPT + generated])).logits[0, -1].float()
                generated.append(int(reference(logits, params, PROMPT, generated).argmax()))
        assert output.outputs[0].token_ids == generated
