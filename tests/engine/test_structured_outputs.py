"""Structured outputs (llguidance): the worker's bitmask against a float64
reference, grammars compiled once and replayed on resume, and end to end through ``LLM`` on the
embedded default model: JSON schemas that validate over seeded samples reaching each bound of the
schema, regex, choice, a grammar, json_object, constrained and plain rows in one batch, and a
constrained request preempted in a tiny KV pool."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from tests.support.lifecycle import settled_metrics
from vllm_actors import LLM, SamplingParams
from vllm_actors.actors.frontend.regex_classes import ascii_classes, ascii_schema_text
from vllm_actors.actors.frontend.structured import check_structured_outputs, grammar_text
from vllm_actors.actors.frontend.tokenizer import load_tokenizer
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.protocol.sampling import StructuredOutputs
from vllm_actors.runner.grammar import Grammars, apply_bitmask
from vllm_actors.runner.grammar_tokenizer import llguidance_tokenizer
from vllm_actors.runner.sampler import Sampler

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
        "likes": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
PROMPT = "Describe a person as JSON:"


# --------------------------------------------------------------------------- the worker's bitmask
def reference_mask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """float64, one token at a time: bit t % 32 of word t // 32 allows token t."""
    out = logits.double().clone()
    for entry, row in enumerate(rows):
        for token in range(out.shape[1]):
            word = int(bitmask[entry, token // 32]) & 0xFFFFFFFF
            if not (word >> (token % 32)) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("rows", [[3, 0], [0, 1, 2, 3, 4]])  # some rows; every row (masked in place)
def test_the_bitmask_masks_exactly_the_disallowed_tokens_of_the_constrained_rows(rows: list[int]) -> None:
    generator = torch.Generator().manual_seed(0)
    vocab, batch = 77, 5  # not a multiple of 32: the last word's high bits lie outside the vocabulary
    logits = torch.randn((batch, vocab), generator=generator, dtype=torch.float32)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), (vocab + 31) // 32), generator=generator,
                            dtype=torch.int64).to(torch.int32)
    bitmask[1, 0] = -1  # every bit set (the sign bit included)
    expected = reference_mask(logits, bitmask, rows)
    masked = logits.clone()
    apply_bitmask(masked, bitmask, rows)
    assert torch.equal(masked.double(), expected)
    untouched = [row for row in range(batch) if row not in rows]
    assert torch.equal(masked[untouched], logits[untouched])  # the unconstrained rows: bit for bit


def test_constrained_rows_are_deferred() -> None:
    """A constrained row does not keep its step from being launched before the previous one is read
    back: the worker feeds the previous step's tokens to the matchers after the forward pass is
    launched (test_constrained_outputs_stay_valid_while_the_previous_step_is_pending)."""
    assert not Sampler.needs_host(SamplingParams(structured_outputs=StructuredOutputs(regex="a+")))
    assert not Sampler.needs_host(SamplingParams())


@pytest.fixture(scope="module")
def grammars(default_gguf_path: str) -> Grammars:
    tokenizer = load_tokenizer(default_gguf_path)
    eos = [tokenizer.eos_token_id or 0]
    return Grammars(lambda: llguidance_tokenizer(default_gguf_path, tokenizer.vocab_size, eos))


def allowed_ids(grammars: Grammars, rows: list) -> list[set[int]]:  # noqa: ANN001
    vocab = grammars.vocab_size()
    logits = torch.zeros((len(rows), vocab))
    grammars.mask(logits, rows, list(range(len(rows))))
    return [set(torch.nonzero(row > float("-inf")).flatten().tolist()) for row in logits]


def test_each_spec_compiles_once_and_a_resumed_row_replays_its_outputs(
    grammars: Grammars, default_gguf_path: str
) -> None:
    tokenizer = load_tokenizer(default_gguf_path)
    spec = StructuredOutputs(json=json.dumps(PERSON))
    before = grammars.compiles
    fresh = grammars.start(spec)
    text = '{"name":"Al","age":4'
    ids = tokenizer.encode(text, add_special_tokens=False)
    for token_id in ids:
        fresh.consume(token_id)
    resumed = grammars.start(spec, replay=ids)  # as after a preemption: outputs replayed into a fresh copy
    assert grammars.compiles == before + 1  # the second start found it cached
    first, second = allowed_ids(grammars, [fresh, resumed])
    assert first == second and first
    assert all(tokenizer.decode([t]).strip()[:1] in "0123456789,}" for t in first if t != tokenizer.eos_token_id)
    start_state = allowed_ids(grammars, [grammars.start(spec)])[0]
    assert start_state != first


def test_a_finished_grammar_allows_only_eos(grammars: Grammars, default_gguf_path: str) -> None:
    tokenizer = load_tokenizer(default_gguf_path)
    row = grammars.start(StructuredOutputs(choice=["yes", "no"]))
    for token_id in tokenizer.encode("yes", add_special_tokens=False):
        row.consume(token_id)
    assert row.is_stopped()
    assert allowed_ids(grammars, [row]) == [{tokenizer.eos_token_id}]


def test_verification_rows_are_masked_from_the_state_after_their_drafts(grammars: Grammars,
                                                                       default_gguf_path: str) -> None:
    """Speculative decoding: a row after drafts gets the mask of a matcher that took them (then the
    matcher is back where it was), and ``valid_drafts`` counts the drafts up to the first refused."""
    from vllm_actors.actors.worker.draft_slots import grammar_checked
    from vllm_actors.actors.worker.step_data import WorkerRequest
    from vllm_actors.protocol.messages import StepPlan

    tokenizer = load_tokenizer(default_gguf_path)
    spec = StructuredOutputs(json=json.dumps(PERSON))
    row, taken = grammars.start(spec), grammars.start(spec)
    drafts = tokenizer.encode('{"name":"Al","age":4', add_special_tokens=False)
    for token_id in drafts:
        taken.consume(token_id)
    vocab = grammars.vocab_size()
    logits = torch.zeros((3, vocab))
    grammars.mask(logits, [row, row, row], [0, 1, 2], [[], drafts[:2], drafts])
    masked = [set(torch.nonzero(line > float("-inf")).flatten().tolist()) for line in logits]
    assert masked[0] == allowed_ids(grammars, [row])[0] == allowed_ids(grammars, [grammars.start(spec)])[0]
    assert masked[2] == allowed_ids(grammars, [taken])[0] != masked[0]
    assert masked[1] != masked[0]
    refused = tokenizer.encode("}", add_special_tokens=False)  # not before "{", nor before the required "pet"
    assert row.valid_drafts(drafts) == len(drafts)
    assert row.valid_drafts(refused + drafts) == 0
    request = WorkerRequest("r", token_ids=[1, 2], num_prompt_tokens=2, num_output_tokens=0,
                            params=SamplingParams(), eos_token_ids=[], grammar=row)
    plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[len(drafts) + 3], new_block_ids=[[]],
                    draft_token_ids={"r": drafts + refused + drafts[:1]})
    cut = grammar_checked(plan, {"r": request})
    assert cut.draft_token_ids == {"r": drafts} and cut.num_tokens == [len(drafts) + 1]
    plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[3], new_block_ids=[[]], draft_token_ids={"r": refused * 2})
    cut = grammar_checked(plan, {"r": request})
    assert cut.draft_token_ids == {} and cut.num_tokens == [1]


# vLLM's IPv4 regex (tests/entrypoints/conftest.py, sample_regex)
IPV4 = r"((25[0-5]|(2[0-4]|1\d|[1-9]|)\d)\.){3}(25[0-5]|(2[0-4]|1\d|[1-9]|)\d)"


@pytest.mark.parametrize("regex,prefix,allowed_first", [(IPV4, "78.", "0123456789"), (r"[a\d]+", "a", "a0123456789")])
def test_a_regex_digit_is_an_ascii_digit(grammars: Grammars, default_gguf_path: str, regex: str, prefix: str,
                                         allowed_first: str) -> None:
    """As vLLM's default backend (xgrammar), ``\\d`` is ``[0-9]``: the mask allows no token starting
    with another script's digit (llguidance alone allows "꯹" or "߇" there)."""
    tokenizer = load_tokenizer(default_gguf_path)
    row = grammars.start(StructuredOutputs(regex=regex))
    for token_id in tokenizer.encode(prefix, add_special_tokens=False):
        row.consume(token_id)
    texts = {tokenizer.decode([token]) for token in allowed_ids(grammars, [row])[0] - {tokenizer.eos_token_id}}
    assert any(text[:1] in "0123456789" for text in texts)
    assert all(text[:1] in allowed_first for text in texts), sorted(t for t in texts if t[:1] not in allowed_first)


@pytest.mark.parametrize("spec,accepted,refused", [
    (StructuredOutputs(regex=IPV4), "78.9.7.77", "78.꯹.7߇.77"),
    (StructuredOutputs(regex=r"\w+ \W"), "action !", "ación !"),
    (StructuredOutputs(json=json.dumps({"type": "string", "pattern": "^\\s+$"})), '"  "', '" \u2003"'),
])
def test_class_escapes_are_xgrammars_ascii_classes(default_gguf_path: str, spec: StructuredOutputs, accepted: str,
                                                   refused: str) -> None:
    """``\\w`` and ``\\s`` too, in regexes and JSON schemas' patterns: a whole text is accepted or not."""
    import llguidance

    tokenizer = load_tokenizer(default_gguf_path)
    grammar = grammar_text(spec)
    vocab = llguidance_tokenizer(default_gguf_path, tokenizer.vocab_size, [tokenizer.eos_token_id or 0])
    for text, whole in ((accepted, True), (refused, False)):
        ids = tokenizer.encode(text, add_special_tokens=False)
        matcher = llguidance.LLMatcher(vocab, grammar, log_level=0)
        assert (matcher.validate_tokens(ids) == len(ids)) is whole, text


def test_ascii_classes_rewrites_only_class_escapes() -> None:
    assert ascii_classes(r"\d\D\w\W") == "[0-9][^0-9][a-zA-Z0-9_][^a-zA-Z0-9_]"
    assert ascii_classes(r"[^\s]\\d\p{L}\.") == r"[^[\t\n\v\f\r\x20\xA0]]\\d\p{L}\."  # an escaped backslash stays
    schema = {"properties": {"pattern": {"type": "string", "pattern": "\\d"}},
              "const": {"pattern": "\\d"}, "anyOf": [{"pattern": "\\w"}]}
    assert json.loads(ascii_schema_text(json.dumps(schema))) == {
        "properties": {"pattern": {"type": "string", "pattern": "[0-9]"}},
        "const": {"pattern": "\\d"}, "anyOf": [{"pattern": "[a-zA-Z0-9_]"}]}  # data (const) untouched


@pytest.mark.parametrize("spec,field", [
    (StructuredOutputs(json="{not json"), "structured_outputs.json"),
    (StructuredOutputs(json='{"type": "nonsense"}'), "structured_outputs.json"),
    (StructuredOutputs(json="[1, 2]"), "structured_outputs.json"),
    (StructuredOutputs(regex="a(b"), "structured_outputs.regex"),
    (StructuredOutputs(grammar="root ::= missing_rule"), "structured_outputs.grammar"),
])
def test_a_bad_spec_is_a_value_error_naming_the_field(spec: StructuredOutputs, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(field)):
        check_structured_outputs(spec, has_tokenizer=True)


def test_structured_outputs_need_a_tokenizer() -> None:
    with pytest.raises(ValueError, match="structured_outputs"):
        check_structured_outputs(StructuredOutputs(choice=["a"]), has_tokenizer=False)


# --------------------------------------------------------------------------- end to end on the default model
@pytest.fixture(scope="module")
def llm(default_gguf_path: str):  # noqa: ANN201
    with LLM(default_gguf_path, seed=0, max_num_seqs=128) as engine:
        yield engine


def constrained(seed: int | None = None, max_tokens: int = 64, temperature: float = 1.0,
                **spec: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputs(**spec))  # type: ignore[arg-type]


# Seeds 0-31 and eight picked from 32-199 (temperature 1, the default model): together their samples
# reach every bound and branch of PERSON, each at least twice - every pet, likes left out and with 0,
# 1, 2 and 3 (maxItems) items, names of 1 and 8 (maxLength) characters, age 120 (the maximum). Seeds
# 0-99 all validated; these 40 give the same coverage in less than half the time (a step's cost grows
# with the rows in it).
JSON_SEEDS = [*range(32), 61, 74, 86, 89, 95, 101, 148, 170]


@pytest.mark.slow
def test_seeded_json_samples_reach_every_bound_of_the_schema_and_validate(llm: LLM) -> None:
    params = [constrained(seed=seed, max_tokens=120, json=json.dumps(PERSON)) for seed in JSON_SEEDS]
    outputs = llm.generate([PROMPT] * len(params), params, use_tqdm=False)
    texts, people = [], []
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text  # the grammar's end: EOS
        person = json.loads(completion.text)
        jsonschema.validate(person, PERSON)
        texts.append(completion.text)
        people.append(person)
    assert len(set(texts)) > len(texts) // 2  # seeded samples at temperature 1, not one answer repeated
    # The samples exercised every bound (if the model or the sampler changes, pick seeds that do again).
    coverage = ({p["pet"] for p in people}, {len(p["likes"]) if "likes" in p else None for p in people},
                {len(p["name"]) for p in people} & {1, 8}, max(p["age"] for p in people))
    assert coverage == ({"cat", "dog", "none"}, {None, 0, 1, 2, 3}, {1, 8}, 120), coverage


def test_regex_choice_grammar_and_json_object(llm: LLM) -> None:
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["positive", "negative", "neutral"]
    grammar = 'root ::= term (("+" | "*") term)*\nterm ::= [1-9] [0-9]?'
    lark = 'start: "ab" /c+/ "d"'
    params = (
        [constrained(seed=s, regex=phone) for s in range(4)]
        + [constrained(seed=s, choice=choices) for s in range(4)]
        + [constrained(seed=s, max_tokens=24, grammar=grammar) for s in range(4)]
        + [constrained(seed=s, max_tokens=12, grammar=lark) for s in range(2)]
    )
    outputs = [o.outputs[0] for o in llm.generate(["Answer:"] * len(params), params, use_tqdm=False)]
    for completion in outputs[:4]:
        assert re.fullmatch(phone, completion.text) and completion.finish_reason == "stop", completion.text
    for completion in outputs[4:8]:
        assert completion.text in choices and completion.finish_reason == "stop", completion.text
    for completion in outputs[8:12]:  # cut at max_tokens ("length") it is still a prefix of the language
        pattern = r"[1-9][0-9]?([+*][1-9][0-9]?)*"
        if completion.finish_reason == "stop":
            assert re.fullmatch(pattern, completion.text), completion.text
        else:
            assert re.fullmatch(pattern + r"[+*]?", completion.text), completion.text
    for completion in outputs[12:14]:
        assert re.fullmatch(r"abc+d", completion.text) or (completion.finish_reason == "length"
                                                             and re.fullmatch(r"abc*", completion.text))
    ask = [{"role": "user", "content": "Reply with a JSON object giving the name and capital of France."}]
    json_object = llm.chat([ask], constrained(temperature=0.0, json_object=True), use_tqdm=False)[0].outputs[0]
    assert json_object.finish_reason == "stop" and isinstance(json.loads(json_object.text), dict), json_object.text


def test_plain_rows_beside_constrained_ones_keep_their_greedy_tokens(llm: LLM) -> None:
    prompts = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    mixed = llm.generate(prompts + [PROMPT] * 3, [plain] * 3 + [constrained(seed=s, json=json.dumps(PERSON),
                                                                             max_tokens=120) for s in range(3)],
                         use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for output in mixed[3:]:
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)


def test_a_grammar_starting_after_a_token_leaves_the_output_free_until_it(llm: LLM, default_gguf_path: str) -> None:
    """start_after (the end of a reasoning model's thinking): the tokens up to it are the model's
    own (greedy: the plain output's), the rest follows the grammar; one never drawn constrains nothing."""
    prompt = "The capital of France is"
    plain = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    trigger = plain[2]
    free = plain.index(trigger) + 1
    late = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=StructuredOutputs(
        regex="[0-9]{3}", start_after=trigger))
    out = llm.generate([prompt], late, use_tqdm=False)[0].outputs[0]
    assert out.token_ids[:free] == plain[:free] and out.finish_reason == "stop"
    rest = out.text[len(load_tokenizer(default_gguf_path).decode(plain[:free])):]
    assert re.fullmatch("[0-9]{3}", rest), out.text
    never = next(t for t in range(1000) if t not in plain)
    unstarted = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, structured_outputs=StructuredOutputs(
        regex="[0-9]{3}", start_after=never))
    assert llm.generate([prompt], unstarted, use_tqdm=False)[0].outputs[0].token_ids == plain


@pytest.mark.slow
def test_a_preempted_constrained_request_still_gives_valid_output(default_gguf_path: str) -> None:
    """Eight constrained requests of up to 8 blocks in a pool of 12: some are preempted and resume by
    recompute, their matchers replaying the outputs they had."""
    with LLM(default_gguf_path, seed=0, block_size=16, num_gpu_blocks_override=12) as llm:
        long_prompt = PROMPT + " Use a short name, say how old they are and which pet they keep."
        params = [constrained(seed=s, max_tokens=100, json=json.dumps(PERSON)) for s in range(8)]
        outputs = llm.generate([long_prompt] * 8, params, use_tqdm=False)
        metrics = settled_metrics(llm, lambda m: m.requests_finished >= 8 and m.kv_blocks_in_use == 0)
        assert metrics.preemptions > 0, "the KV pool was meant to force preemption"
        for output in outputs:
            completion = output.outputs[0]
            assert completion.finish_reason == "stop", completion.text
            jsonschema.validate(json.loads(completion.text), PERSON)


def test_offline_llm_refuses_a_bad_schema_and_keeps_serving(llm: LLM) -> None:
    with pytest.raises(ValueError, match="structured_outputs.json"):
        llm.generate([PROMPT], constrained(json='{"type": "nonsense"}'), use_tqdm=False)
    out = llm.generate([PROMPT], constrained(seed=0, choice=["a", "b"]), use_tqdm=False)[0].outputs[0]
    assert out.text in ("a", "b")


def test_the_worker_grammars_tokenizer_spans_the_models_vocabulary(default_gguf_path: str) -> None:
    tokenizer = load_tokenizer(default_gguf_path)
    ll = llguidance_tokenizer(default_gguf_path, tokenizer.vocab_size + 64, [tokenizer.eos_token_id or 0])
    assert ll.vocab_size == tokenizer.vocab_size + 64  # padded logits: the extra ids are never allowed


def test_constrained_outputs_stay_valid_while_the_previous_step_is_pending(
    default_gguf_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a busy GPU (a launched step never looks done), every step is launched before the
    previous one is read back: its masks must still follow every token drawn, so seeded JSON and
    regex samples validate, and plain rows beside them keep their greedy tokens."""
    from vllm_actors.actors.worker.step_data import PendingStep

    monkeypatch.setenv("VLLM_ACTORS_DEFER_STEPS", "1")
    monkeypatch.setattr(PendingStep, "ready", lambda self: False)
    launched: list[bool] = []
    feed = Worker._feed_grammars

    def watched(pending: PendingStep | None) -> None:
        launched.append(pending is not None and not pending.grammars_fed)
        feed(pending)

    monkeypatch.setattr(Worker, "_feed_grammars", staticmethod(watched))
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    with LLM(default_gguf_path, seed=0, executor="inprocess") as llm:
        alone = llm.generate(["Once upon a time"], plain, use_tqdm=False)[0].outputs[0].token_ids
        params = ([constrained(seed=s, json=json.dumps(PERSON), max_tokens=120) for s in range(6)]
                  + [constrained(seed=s, regex=phone) for s in range(3)] + [plain])
        outputs = llm.generate([PROMPT] * 9 + ["Once upon a time"], params, use_tqdm=False)
    for output in outputs[:6]:
        jsonschema.validate(json.loads(output.outputs[0].text), PERSON)
    for output in outputs[6:9]:
        assert re.fullmatch(phone, output.outputs[0].text), output.outputs[0].text
    assert outputs[9].outputs[0].token_ids == alone
    assert any(launched)  # masks were filled while a step was still pending
