"""Borrowed KV capacity in the model, in process (models/kv_borrow.py): a 3,000-token request whose
KV does not fit its home's pool runs on the home with blocks lent by two lenders (their caches and
block ids their own; their answers through direct calls, the transport's stand-in), prefilled in
chunks of 512 and decoded, in the same steps as the home's short requests, while the first lender
serves short requests of its own from the rest of its pool. Every greedy token equals transformers'
in float32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import TP_QWEN3_SHAPE
from tests.engine.test_correctness import reference_generate
from tests.support.kv_borrow_ranks import BLOCK, LONG, MAX_TOKENS, Serving, prompts, run_rank
from tests.support.tiny_models import PagedRunner, build_checkpoint
from vllm_actors.kernels.attention import TorchPagedAttention
from vllm_actors.models.kv_borrow import BorrowingAttention, Guest, LenderShare
from vllm_actors.models.loader import load_model


@pytest.fixture(scope="module")
def qwen3_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("borrow_qwen3"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE | {"max_position_embeddings": 4096, "num_hidden_layers": 2})


def test_a_request_on_borrowed_blocks_matches_transformers_beside_short_requests(qwen3_long: Path) -> None:
    long, home_shorts, lender_shorts = prompts(3)
    home_model, _ = load_model(str(qwen3_long), torch.float32, torch.device("cpu"))
    lender_model, _ = load_model(str(qwen3_long), torch.float32, torch.device("cpu"))
    backend = BorrowingAttention(TorchPagedAttention())
    home_model.attn_backend = backend
    home = PagedRunner(home_model, BLOCK, num_blocks=80, seed=1)
    lender = PagedRunner(lender_model, BLOCK, num_blocks=80, seed=2)  # 70 lent, 10 for its own request
    second = PagedRunner(lender_model, BLOCK, num_blocks=60, seed=3)  # lends all of it
    shares = [LenderShare(lender.kv_caches), LenderShare(second.kv_caches)]
    shares[0].lend("long", 0, [lender.free.pop() for _ in range(70)])
    shares[1].lend("long", 70, [second.free.pop() for _ in range(60)])
    home.tables[0] = [0] * 130  # the lenders' blocks: placeholders in the home's row
    guest = Guest("long", [(shares[0].attend, 70), (shares[1].attend, 60)])
    replicas = [Serving(home, {0: long, **home_shorts}, {0: guest}, backend), Serving(lender, lender_shorts)]
    steps = 0
    while any([replica.step() for replica in replicas]):  # the lender's own steps between the home's
        steps += 1
    assert steps >= LONG // 512
    got = replicas[0].outputs | replicas[1].outputs
    assert len(home.tables[0]) - 130 <= 80 and len(home.tables[0]) * BLOCK >= LONG + MAX_TOKENS - 1
    every = [long, home_shorts[1], home_shorts[2], lender_shorts[3]]
    want = [tokens for tokens, _ in reference_generate(qwen3_long, every, max_tokens=MAX_TOKENS)]
    assert [got[seq][:len(w)] for seq, w in zip((0, 1, 2, 3), want, strict=True)] == want
    assert len(set(got[0])) > 1 or len(want[0]) < 2


def test_the_lender_answers_over_gloo_from_a_thread_beside_its_own_steps(qwen3_long: Path, tmp_path: Path) -> None:
    """Two processes: the home (the long request on 58 blocks of its own and 130 lent, beside two
    short requests) and the lender (its thread answering each layer over gloo while its main thread
    serves its own short request again and again). Both give transformers' tokens."""
    import torch.multiprocessing as mp

    mp.start_processes(run_rank, args=(str(qwen3_long), str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    home = json.loads((tmp_path / "rank0.json").read_text())
    lender = json.loads((tmp_path / "rank1.json").read_text())
    assert lender["error"] is None and lender["same_every_round"]
    assert lender["calls"] >= 2 * (LONG // 512 + MAX_TOKENS)  # every layer of every step of the guest
    assert lender["beside"] > 0, "the lender's own steps were meant to run while the guest's did"
    long, home_shorts, lender_shorts = prompts(3)
    want = [tokens for tokens, _ in reference_generate(qwen3_long, [long, *home_shorts.values(),
                                                                    *lender_shorts.values()], max_tokens=MAX_TOKENS)]
    got = [home["outputs"][str(seq)] for seq in (0, 1, 2)] + [lender["outputs"]["3"]]
    assert [ours[:len(theirs)] for ours, theirs in zip(got, want, strict=True)] == want
