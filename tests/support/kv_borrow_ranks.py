"""Borrowed KV tests' parts: replicas stepped by hand (``Serving``), the prompts, and the two
processes of the gloo test (a home and a lender, ``run_rank``)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tests.support.tiny_models import PagedRunner

BLOCK, CHUNK, MAX_TOKENS = 16, 512, 6
LONG = 3000  # 188 blocks


class Serving:
    """One replica's sequences, a step per call: prompts in chunks of CHUNK, then decodes."""

    def __init__(self, runner: PagedRunner, prompts: dict[int, list[int]], guests: dict[int, Any] | None = None,
                 backend: Any = None) -> None:
        self.runner, self.prompts, self.guests, self.backend = runner, prompts, guests or {}, backend
        self.done = dict.fromkeys(prompts, 0)
        self.outputs: dict[int, list[int]] = {seq: [] for seq in prompts}

    def step(self) -> bool:
        """One step; False once every sequence has its tokens."""
        chunks: dict[int, list[int]] = {}
        for seq, prompt in self.prompts.items():
            if len(self.outputs[seq]) < MAX_TOKENS:
                done = self.done[seq]
                chunks[seq] = prompt[done:done + CHUNK] if done < len(prompt) else self.outputs[seq][-1:]
        if not chunks:
            return False
        if self.backend is not None:  # the guests by their index in the step's batch
            self.backend.begin_step({index: self.guests[seq] for index, seq in enumerate(chunks) if seq in self.guests})
        logits = self.runner.step(chunks)
        for seq, tokens in chunks.items():
            if self.done[seq] < len(self.prompts[seq]):
                self.done[seq] += len(tokens)
            if self.done[seq] == len(self.prompts[seq]):
                self.outputs[seq].append(int(logits[seq][-1].argmax()))
        return True

    def run(self) -> dict[int, list[int]]:
        while self.step():
            pass
        return self.outputs

    def forget(self) -> None:
        """Every sequence's blocks back to the runner's free list (its next round starts afresh)."""
        for table in self.runner.tables.values():
            self.runner.free.extend(table)
        self.runner.tables.clear()
        self.runner.lens.clear()


def prompts(seed: int) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]]]:
    """The long prompt, the home's short ones, the lender's own."""
    rng = random.Random(seed)
    long = [rng.randrange(500) for _ in range(LONG)]
    home = {1: [rng.randrange(500) for _ in range(40)], 2: [rng.randrange(500) for _ in range(90)]}
    return long, home, {3: [rng.randrange(500) for _ in range(70)]}


def run_rank(rank: int, path: str, store: str, out_dir: str) -> None:
    """Rank 0: the home, the long request on 58 blocks of its own and 130 lent by rank 1, beside its
    short requests. Rank 1: the lender, its thread answering the home while its main thread serves
    its own short requests again and again until the home is done. Each writes its outputs."""
    import torch
    import torch.distributed as dist

    from vllm_actors.kernels.attention import TorchPagedAttention
    from vllm_actors.models.kv_borrow import BorrowingAttention, Guest, LenderShare
    from vllm_actors.models.kv_borrow_link import LenderServer, RemoteLender
    from vllm_actors.models.loader import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    long, home_shorts, lender_shorts = prompts(3)
    result: dict[str, Any] = {}
    if rank == 0:
        backend = BorrowingAttention(TorchPagedAttention())
        model.attn_backend = backend
        runner = PagedRunner(model, BLOCK, num_blocks=80, seed=1)
        runner.tables[0] = [0] * 130  # the lender's blocks: placeholders in the home's row
        remote = RemoteLender(1)
        serving = Serving(runner, {0: long, **home_shorts}, {0: Guest("long", [(remote, 130)])}, backend)
        result["outputs"] = serving.run()
        remote.stop()
    else:
        runner = PagedRunner(model, BLOCK, num_blocks=140, seed=2)  # 130 lent, 10 for its own requests
        share = LenderShare(runner.kv_caches)
        share.lend("long", 0, [runner.free.pop() for _ in range(130)])
        config = model.config
        server = LenderServer(share, 0, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                              torch.float32)
        thread = server.start()
        rounds: list[dict[int, list[int]]] = []
        marks: list[int] = []  # the home's layers answered so far, after each of its own steps
        while thread.is_alive():  # its own requests, step by step, while the home's guest runs
            own = Serving(runner, lender_shorts)
            while own.step():
                marks.append(server.num_calls)
            rounds.append(own.outputs)
            own.forget()
        thread.join()
        result.update(outputs=rounds[0], same_every_round=all(r == rounds[0] for r in rounds),
                      rounds=len(rounds), calls=server.num_calls,
                      beside=sum(1 for mark in marks if 0 < mark < server.num_calls),
                      error=repr(server.error) if server.error else None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
