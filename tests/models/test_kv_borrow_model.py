"""Borrowed KV capacity in the model, in process (models/kv_borrow.py): a 3,000-token request whose
KV does not fit its home's pool runs on the home with blocks lent by two lenders (their caches and
block ids their own; their answers through direct calls, the transport's stand-in), prefilled in
chunks of 512 and decoded, in the same steps as the home's short requests, while the first lender
serves short requests of its own from the rest of its pool. Every greedy token equals transformers'
in float32. And the Python switch interval a borrowing worker sets for its lender threads."""

from __future__ import annotations

import json
import sys
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
from vllm_actors.runner.kv_borrowing import shorten_switch_interval


@pytest.fixture(scope="module")
def qwen3_long(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_checkpoint(tmp_path_factory.mktemp("borrow_qwen3"), "qwen3", tie_word_embeddings=True,
                            shape=TP_QWEN3_SHAPE | {"max_position_embeddings": 4096, "num_hidden_layers": 2})


def test_a_request_on_borrowed_blocks_matches_transformers_beside_short_requests(qwen3_long: Path) -> None:
    long, home_shorts, lender_shorts = prompts(3)
    home_model, _ = load_model(str(qwen3_long), torch.float32, torch.device("cpu"))
    lender_model, _ = load_model(str(qwen3_long), torch.float32, torch.device("cpu"))
    backend = BorrowingAttention(TorchPagedAttention(), BLOCK)
    home_model.attn_backend = backend
    home = PagedRunner(home_model, BLOCK, num_blocks=80, seed=1)
    lender = PagedRunner(lender_model, BLOCK, num_blocks=80, seed=2)  # 70 lent, 10 for its own request
    second = PagedRunner(lender_model, BLOCK, num_blocks=60, seed=3)  # lends all of it
    shares = [LenderShare(lender.kv_caches), LenderShare(second.kv_caches)]
    shares[0].lend("long", [lender.free.pop() for _ in range(70)])
    shares[1].lend("long", [second.free.pop() for _ in range(60)])
    home.tables[0] = [0] * 130  # the lenders' blocks: placeholders in the home's row
    guest = Guest("long", [(shares[0].attend, 70), (shares[1].attend, 60)])
    replicas = [Serving(home, {0: long, **home_shorts}, {0: guest}, backend),
                Serving(lender, {4: lender_shorts[4]})]
    steps = 0
    while any([replica.step() for replica in replicas]):  # the lender's own steps between the home's
        steps += 1
    assert steps >= LONG // 512
    got = replicas[0].outputs | replicas[1].outputs
    assert len(home.tables[0]) - 130 <= 80 and len(home.tables[0]) * BLOCK >= LONG + MAX_TOKENS - 1
    every = [long, home_shorts[1], home_shorts[2], lender_shorts[4]]
    want = [tokens for tokens, _ in reference_generate(qwen3_long, every, max_tokens=MAX_TOKENS)]
    assert [got[seq][:len(w)] for seq, w in zip((0, 1, 2, 4), want, strict=True)] == want
    assert len(set(got[0])) > 1 or len(want[0]) < 2


def test_two_replicas_each_home_and_lender_over_gloo_give_transformers_tokens(qwen3_long: Path,
                                                                               tmp_path: Path) -> None:
    """Two processes, each a home and a lender at once (run_rank): the 3,000-token request on rank 0
    with 130 blocks lent by rank 1, a 1,000-token one on rank 1 with 40 lent by rank 0, each beside
    short requests; each rank's thread answers the other's layers over gloo while its main thread
    steps, and rank 1 keeps serving a short request of its own while rank 0's guest runs."""
    import torch.multiprocessing as mp

    mp.start_processes(run_rank, args=(str(qwen3_long), str(tmp_path / "store"), str(tmp_path)), nprocs=2,
                       start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [rank["error"] for rank in ranks] == [None, None]
    assert ranks[1]["calls"] >= 2 * (LONG // 512 + MAX_TOKENS)  # every layer of every step of the guest
    assert ranks[1]["beside"] > 0, "rank 1's own steps were meant to run while rank 0's guest did"
    assert ranks[1]["same_every_round"]
    long, home_shorts, lender_prompts = prompts(3)
    every = [long, *home_shorts.values(), *lender_prompts.values()]
    want = [tokens for tokens, _ in reference_generate(qwen3_long, every, max_tokens=MAX_TOKENS)]
    got = [ranks[0]["outputs"][str(seq)] for seq in (0, 1, 2)] + [ranks[1]["outputs"][str(seq)] for seq in (3, 4)]
    assert [ours[:len(theirs)] for ours, theirs in zip(got, want, strict=True)] == want


def test_a_borrowing_worker_shortens_pythons_switch_interval_unless_told_not_to() -> None:
    """Its lender threads take the GIL from a busy main thread at every layer (``kv_borrowing.SWITCH``)."""
    before = sys.getswitchinterval()
    try:
        assert shorten_switch_interval({}) == pytest.approx(200e-6)
        assert shorten_switch_interval({"VLLM_ACTORS_BORROW_SWITCH_US": "1000"}) == pytest.approx(1e-3)
        assert shorten_switch_interval({"VLLM_ACTORS_BORROW_SWITCH_US": "0"}) == pytest.approx(1e-3)  # left as it is
        with pytest.raises(ValueError, match="VLLM_ACTORS_BORROW_SWITCH_US"):
            shorten_switch_interval({"VLLM_ACTORS_BORROW_SWITCH_US": "-1"})
    finally:
        sys.setswitchinterval(before)
