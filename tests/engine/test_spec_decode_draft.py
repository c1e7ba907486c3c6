"""Speculative decoding with a draft model (``method: draft_model``), in process.

The fake model as its own draft (its own "KV" of token ids under the same block ids): every draft
is right exactly when the worker keeps the draft's KV in step with the request's tokens (catch-ups
in several passes, rejected drafts' slots rewritten, preemption, chunked prefill, prefix hits).
Tiny random checkpoints: a one-layer draft of the tiny Qwen3 gives the tokens of no speculation
(greedy and seeded rows); the target as its own draft has every draft accepted; a draft of another
vocabulary or a shorter context is refused.
"""

from __future__ import annotations

import json
import shutil
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.test_spec_decode import PROMPTS, CopyingRunner, run
from tests.support.tiny_models import build_checkpoint
from vllm_actors import LLM, SamplingParams
from vllm_actors.actors.worker.draft_model import DraftProposer
from vllm_actors.actors.worker.step_data import BatchInput, WorkerRequest
from vllm_actors.clients.inprocess import InProcessEngine
from vllm_actors.protocol.config import EngineConfig
from vllm_actors.protocol.events import StepFinished
from vllm_actors.protocol.messages import StepPlan
from vllm_actors.protocol.speculative import WORKER_DRAFT, parse_speculative_config


class FakeDraft(CopyingRunner):
    """The target's function as a draft model (wrong after one context in three with ``errs``); its
    input ids on the "device" filled as a GPU would. A catch-up pass checks that the draft "KV" it
    trusts (before the pass's first position) holds what the target's holds there: the tokens."""

    max_num_tokens = 5  # a prompt's catch-up takes several passes

    def __init__(self, target: CopyingRunner, errs: bool) -> None:
        super().__init__(num_blocks=target.num_blocks, block_size=target.block_size)
        self.target, self.errs = target, errs

    def next_token(self, context: list[int]) -> int:
        token = super().next_token(context)
        return (token + 1) % self.vocab_size if self.errs and zlib.crc32(bytes(context)) % 3 == 0 else token

    def execute(self, batch: BatchInput) -> torch.Tensor:
        if batch.deferred is not None:
            for index, row in zip(batch.deferred.flat_index, batch.deferred.source_row, strict=True):
                batch.token_ids[index] = int(batch.deferred.source[row])
        else:
            first = 0
            for table, query_len in zip(batch.block_tables, batch.query_lens, strict=True):
                trusted = [self._slot(table, position) for position in range(batch.positions[first])]
                assert [self.slots[s] for s in trusted] == [self.target.slots[s] for s in trusted]
                first += query_len
        return super().execute(batch)


def fake_engine(draft: bool, num_blocks: int, errs: bool = False) -> tuple[InProcessEngine, list[StepFinished]]:
    runner = CopyingRunner(num_blocks=num_blocks, block_size=4)
    spec = None
    if draft:
        runner.drafter = FakeDraft(runner, errs)  # type: ignore[attr-defined]  # read by build_worker
        spec = parse_speculative_config({"method": "draft_model", "model": "fake", "num_speculative_tokens": 3},
                                        adaptive=False)
    config = EngineConfig(model="fake", block_size=4, max_num_batched_tokens=8, max_model_len=512,
                          speculative_config=spec)
    engine = InProcessEngine(config, serialize=True, runner=runner, tokenizer=None)
    engine.step_hooks.append(lambda e: e.check_invariants())
    steps: list[StepFinished] = []
    engine.event_listeners.append(lambda batch: steps.extend(e for e in batch.events if isinstance(e, StepFinished)))
    return engine, steps


@pytest.mark.parametrize("errs", [False, True], ids=["exact-draft", "erring-draft"])
def test_draft_kv_follows_the_tokens_under_preemption_chunking_and_rejections(errs: bool) -> None:
    """An exact draft has every draft accepted; an erring one some; the outputs are those of no
    speculation (a small budget: requests skip drafting on some steps, then catch up)."""
    prompts = [*PROMPTS, PROMPTS[0] + [5, 6, 7]]  # the last one hits the first one's cached blocks
    params = [SamplingParams(temperature=0.0, max_tokens=30 + i, ignore_eos=True) for i in range(len(prompts))]
    expected = run(fake_engine(False, 18)[0], prompts, params)
    engine, steps = fake_engine(True, 18, errs)
    assert run(engine, prompts, params) == expected
    drafted = sum(step.num_draft_tokens for step in steps)
    accepted = sum(step.num_accepted_tokens for step in steps)
    assert 0 < accepted < drafted if errs else 0 < accepted == drafted
    assert engine.scheduler.stats.num_preemptions > 0


def test_a_request_that_skipped_drafting_catches_up_from_its_last_confirmed_draft() -> None:
    """Drafts rejected, then plain decode steps: the next proposal trusts only the draft KV of the
    request's own tokens (FakeDraft checks it against the target's), not the rejected drafts'."""
    target = CopyingRunner(num_blocks=8, block_size=4)
    proposer = DraftProposer(FakeDraft(target, errs=False))
    request = WorkerRequest("r", token_ids=[7, 1, 2, 3, 4, 5], num_prompt_tokens=6, num_output_tokens=0,
                            params=SamplingParams(), eos_token_ids=[], block_table=[3, 5, 1, 6])

    def propose(num_drafts: int) -> list[int]:
        for position, token in enumerate(request.token_ids[:-1]):  # the target's KV: its known tokens
            target.slots[target._slot(request.block_table, position)] = token
        plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[1 + num_drafts], new_block_ids=[[]],
                        draft_token_ids={"r": [WORKER_DRAFT] * num_drafts})
        return proposer.propose(plan, {"r": request}).draft_token_ids["r"]

    first = propose(3)
    request.token_ids += [(first[0] + 1) % 97, 9, 8, 6]  # the first draft rejected; three plain decodes
    assert propose(2) == target.reference(request.token_ids, 2)


# ------------------------------------------------------------------ tiny checkpoints
@pytest.fixture(scope="module")
def one_layer_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random Qwen3 of the tiny Qwen3's vocabulary (another seed: its drafts mostly wrong)."""
    return build_checkpoint(tmp_path_factory.mktemp("draft1"), "qwen3", tie_word_embeddings=True, seed=3,
                            shape={"num_hidden_layers": 1})


PROMPT_IDS = [[(i * 7 + j * 3) % 500 for j in range(5 + 9 * i)] for i in range(4)]


def generate(target: Path, draft: Path | None, prompts: list[list[int]],
             params: list[SamplingParams]) -> tuple[list[list[int]], Any]:
    """``draft`` None: without speculation."""
    spec = None if draft is None else parse_speculative_config(  # vLLM's spelling: no method
        {"model": str(draft), "num_speculative_tokens": 3}, adaptive=False)
    with LLM(str(target), dtype="float32", executor="inprocess", speculative_config=spec, block_size=4,
             max_model_len=128, max_num_batched_tokens=16, num_gpu_blocks_override=40) as llm:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(output.outputs[0].token_ids) for output in outputs], llm.get_metrics().spec_decode


def test_a_smaller_draft_gives_the_tokens_of_no_speculation(tiny_qwen3: Path, one_layer_draft: Path) -> None:
    """Greedy and seeded rows; beside each, the same row with penalties and a logit bias."""
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=12, ignore_eos=True)
              for i in range(len(PROMPT_IDS))]
    controlled = [SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=12, ignore_eos=True,
                                 presence_penalty=1.0, frequency_penalty=0.5, logit_bias={7: 4.0}) for p in params]
    expected, _ = generate(tiny_qwen3, None, PROMPT_IDS * 2, params + controlled)
    got, spec = generate(tiny_qwen3, one_layer_draft, PROMPT_IDS * 2, params + controlled)
    assert got == expected
    assert expected[: len(params)] != expected[len(params):]  # the controls matter
    assert spec.num_draft_tokens > 0


def test_the_target_as_its_own_draft_has_every_draft_accepted(tiny_qwen3: Path) -> None:
    greedy = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)] * len(PROMPT_IDS)
    _, spec = generate(tiny_qwen3, tiny_qwen3, PROMPT_IDS, greedy)
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens == spec.num_draft_tokens
    assert spec.accepted_per_pos[0] == spec.num_drafts


def _edited(source: Path, folder: Path, **changes: int) -> Path:
    """A copy of a checkpoint's config (all a draft's checks read) with some fields changed."""
    folder.mkdir()
    config = json.loads((source / "config.json").read_text()) | changes
    (folder / "config.json").write_text(json.dumps(config))
    shutil.copy(source / "generation_config.json", folder)
    return folder


@pytest.mark.parametrize(("changes", "message"), [({"vocab_size": 600}, "vocabulary of 600 tokens"),
                                                   ({"max_position_embeddings": 64}, "pass max_model_len <= 64")])
def test_a_draft_of_another_vocabulary_or_shorter_context_is_refused(
        tiny_qwen3: Path, tmp_path: Path, changes: dict[str, int], message: str) -> None:
    from vllm_actors.runner.model_runner import ModelRunner

    draft = _edited(tiny_qwen3, tmp_path / "draft", **changes)
    spec = parse_speculative_config({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=message):
        ModelRunner(EngineConfig(model=str(tiny_qwen3), dtype="float32", max_model_len=128,
                                 speculative_config=spec))
    assert EngineConfig(model=str(tiny_qwen3), tensor_parallel_size=2,  # the draft on every rank, unsharded
                        speculative_config=spec).speculative_config == spec


def test_a_short_catch_up_is_verification_shaped_so_decode_graphs_serve_it() -> None:
    """After its first proposal a request catches up a few tokens: every one of them gets logits, so
    ``as_decode_rows`` takes the pass (the draft's decode graphs, not an eager pass); a prompt's long
    catch-up asks only its last row. The drafts are the reference's either way."""
    from vllm_actors.runner.verify_rows import as_decode_rows

    target = CopyingRunner(num_blocks=8, block_size=4)
    draft = FakeDraft(target, errs=False)
    draft.max_num_tokens = 64
    seen: list[BatchInput] = []
    execute = draft.execute
    draft.execute = lambda batch: seen.append(batch) or execute(batch)  # type: ignore[method-assign]
    proposer = DraftProposer(draft)
    request = WorkerRequest("r", token_ids=[7, 1, 2, 3, 4, 5, 6, 8, 9, 10], num_prompt_tokens=10,
                            num_output_tokens=0, params=SamplingParams(), eos_token_ids=[],
                            block_table=[3, 5, 1, 6, 0, 2, 4, 7])

    def propose(num_drafts: int) -> list[int]:
        for position, token in enumerate(request.token_ids[:-1]):
            target.slots[target._slot(request.block_table, position)] = token
        plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[1 + num_drafts], new_block_ids=[[]],
                        draft_token_ids={"r": [WORKER_DRAFT] * num_drafts})
        return proposer.propose(plan, {"r": request}).draft_token_ids["r"]

    first = propose(3)
    assert seen[0].logits_indices == [9]  # the prompt: its last row only
    request.token_ids += [*first, target.reference(request.token_ids + first, 1)[0]]  # all right, a bonus token
    seen.clear()
    assert propose(3) == target.reference(request.token_ids, 3)
    catch_up = seen[0]
    assert catch_up.query_lens == [2] and catch_up.logits_indices == [0, 1]  # the last draft and the bonus
    assert as_decode_rows(catch_up, kv_bytes_per_token=1.0, weight_bytes=1e9) is not None


def test_under_tensor_parallelism_every_rank_takes_rank_0s_drafts() -> None:
    """A rank whose own draft rounded differently proposes rank 0's drafts (one broadcast, -1 past a
    proposal's end), and keeps its own in its draft-KV bookkeeping (its KV holds those)."""
    from dataclasses import dataclass

    @dataclass
    class Rank1:
        rank: int = 1
        size: int = 2
        enabled: bool = True
        sent: torch.Tensor | None = None

        def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
            self.sent = x.clone()
            return torch.tensor([11, 12, -1], dtype=torch.long)  # rank 0 drafted two

    target = CopyingRunner(num_blocks=8, block_size=4)
    ranks = Rank1()
    proposer = DraftProposer(FakeDraft(target, errs=False), ranks)
    request = WorkerRequest("r", token_ids=[7, 1, 2, 3, 4, 5], num_prompt_tokens=6, num_output_tokens=0,
                            params=SamplingParams(), eos_token_ids=[], block_table=[3, 5, 1, 6])
    for position, token in enumerate(request.token_ids[:-1]):
        target.slots[target._slot(request.block_table, position)] = token
    plan = StepPlan(step_id=0, req_ids=["r"], num_tokens=[4], new_block_ids=[[]],
                    draft_token_ids={"r": [WORKER_DRAFT] * 3})
    proposed = proposer.propose(plan, {"r": request})
    own = target.reference(request.token_ids, 3)
    assert ranks.sent is not None and ranks.sent.tolist() == own
    assert proposed.draft_token_ids == {"r": [11, 12]} and proposed.num_tokens == [3]
    assert proposer._kv["r"].written == own[:-1]
