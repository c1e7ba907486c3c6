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
        """Its sequences leave the runner; the blocks of those without a loan go back to its free
        list (a guest's row holds placeholders)."""
        for seq in self.prompts:
            table = self.runner.tables.pop(seq, [])
            if seq not in self.guests:
                self.runner.free.extend(table)
            self.runner.lens.pop(seq, None)


def prompts(seed: int) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]]]:
    """The long prompt, the home's short ones, the lender's own (a 1,000-token one, then a short one)."""
    rng = random.Random(seed)
    long = [rng.randrange(500) for _ in range(LONG)]
    home = {1: [rng.randrange(500) for _ in range(40)], 2: [rng.randrange(500) for _ in range(90)]}
    return long, home, {3: [rng.randrange(500) for _ in range(1000)], 4: [rng.randrange(500) for _ in range(70)]}


def run_rank(rank: int, path: str, store: str, out_dir: str) -> None:
    """Two replicas, each a home and a lender at once. Rank 0 runs the long request on 58 blocks of
    its own and 130 lent by rank 1, beside two short requests, and lends 40 blocks to rank 1's
    1,000-token request, which rank 1 runs on those and 23 of its own beside a short request; then
    rank 1 serves that short request again and again until rank 0 is done. Each rank's thread
    answers the other's layers while its main thread steps. Each writes its outputs."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from vllm_actors.kernels.attention import TorchPagedAttention
    from vllm_actors.models.kv_borrow import BorrowingAttention, Guest, LenderShare
    from vllm_actors.models.kv_borrow_link import LenderServer, RemoteLender
    from vllm_actors.models.loader import load_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2,
                            timeout=timedelta(minutes=5))
    model, _ = load_model(path, torch.float32, torch.device("cpu"))
    long, home_shorts, lender_prompts = prompts(3)
    backend = BorrowingAttention(TorchPagedAttention(), BLOCK)
    model.attn_backend = backend
    runner = PagedRunner(model, BLOCK, num_blocks=120 if rank == 0 else 180, seed=1 + rank)
    share = LenderShare(runner.kv_caches)
    share.lend("long" if rank == 1 else "medium", [runner.free.pop() for _ in range(130 if rank == 1 else 40)])
    config = model.config
    server = LenderServer(share, 1 - rank, config.num_attention_heads, config.num_key_value_heads, config.head_dim,
                          torch.float32)
    thread = server.start()
    remote = RemoteLender(1 - rank)
    result: dict[str, Any] = {}
    if rank == 0:
        runner.tables[0] = [0] * 130  # the lender's blocks: placeholders in the home's row
        serving = Serving(runner, {0: long, **home_shorts}, {0: Guest("long", [(remote, 130)])}, backend)
        result["outputs"] = serving.run()
        remote.stop()
        thread.join()
    else:
        runner.tables[3] = [0] * 40
        first = Serving(runner, lender_prompts, {3: Guest("medium", [(remote, 40)])}, backend)
        result["outputs"] = first.run()
        first.forget()
        remote.stop()
        rounds: list[dict[int, list[int]]] = []
        marks: list[int] = []  # the home's layers answered so far, after each of its own steps
        while thread.is_alive():  # its own short request, step by step, while rank 0's guest runs
            own = Serving(runner, {4: lender_prompts[4]}, backend=backend)
            while own.step():
                marks.append(server.num_calls)
            rounds.append(own.outputs)
            own.forget()
        thread.join()
        result.update(same_every_round=all(r == {4: result["outputs"][4]} for r in rounds), rounds=len(rounds),
                      beside=sum(1 for mark in marks if 0 < mark < server.num_calls))
    result.update(calls=server.num_calls, error=repr(server.error) if server.error else None)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


LINK_CHUNKS = (7, 10, 9, 1, 1)  # a guest's steps in the link test: chunks crossing the shares, then decodes
IDLE_S = 2  # the link test's short group timeout: its lenders wait longer than that before the first call


def run_link_rank(rank: int, store: str, out_dir: str, transport: str = "gloo") -> None:
    """Three processes over gloo, no model: rank 0 a home whose guest borrows 3 blocks of rank 1 and
    2 of rank 2 (blocks of 4, bfloat16 K/V, two layers), asking both at every layer; the lenders
    answer on their threads. Rank 0 writes its outputs with what they should be (causal attention
    over the whole context); each lender the calls it answered. ``transport`` "shm": q, k, v and the
    answers in shared regions (of 4 tokens: a larger chunk goes over gloo), named after ``out_dir``."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from vllm_actors.kernels.attention import TorchPagedAttention, build_attention_metadata
    from vllm_actors.models.kv_borrow import BorrowingAttention, Guest, LenderShare
    from vllm_actors.models.kv_borrow_link import LenderServer, QkvStaging, RemoteLender, SharedRegions, exchange_group
    from vllm_actors.runtime.shm_regions import region_prefix

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=3,
                            timeout=timedelta(minutes=2))
    dist.barrier()  # every rank up: the short group below connects at once
    short = dist.new_group([0, 1, 2], backend="gloo", timeout=timedelta(seconds=IDLE_S))
    group = exchange_group(3)
    block, heads, kv_heads, dim, layers = 4, 4, 2, 16, 2
    generator = torch.Generator().manual_seed(10 + rank)

    def cache() -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.randn(8, block, kv_heads, dim, generator=generator).to(torch.bfloat16),
                torch.randn(8, block, kv_heads, dim, generator=generator).to(torch.bfloat16))

    kv_caches = [cache() for _ in range(layers)]
    result: dict[str, Any] = {}
    regions = SharedRegions(region_prefix(out_dir), 4, torch.device("cpu")) if transport == "shm" else None
    if rank:
        share = LenderShare(kv_caches, wait_s=0.5)
        share.lend("long", [6, 2, 5] if rank == 1 else [1, 7])
        server = LenderServer(share, 0, heads, kv_heads, dim, torch.bfloat16, group, regions, rank)
        server.start().join()
        result.update(calls=server.num_calls, error=repr(server.error) if server.error else None,
                      regions=sorted(regions._regions) if regions is not None else [])
    else:
        try:  # a receive on a group of IDLE_S seconds gives up (as the world's did after 10 min)
            dist.recv(torch.empty(1), 1, group=short, tag=9)
            result["short_recv_failed"] = False
        except RuntimeError:
            result["short_recv_failed"] = True
        staging = QkvStaging(regions, 0)  # the lenders' threads, idle all that time on the exchange group, still answer
        lenders = [RemoteLender(1, group, staging), RemoteLender(2, group, staging)]
        backend = BorrowingAttention(TorchPagedAttention(), block)
        guest = Guest("long", [(lenders[0], 3), (lenders[1], 2)])
        table = [0] * 5 + [3, 4, 6, 1]  # placeholders where the lenders' blocks sit, then the home's
        history = [[torch.empty(0, kv_heads, dim, dtype=torch.bfloat16)] * 2 for _ in range(layers)]
        scale, seq_len, worst = dim ** -0.5, 0, 0.0
        for num_tokens in LINK_CHUNKS:
            seq_len += num_tokens
            backend.begin_step({0: guest})
            meta = backend.prepare(build_attention_metadata([num_tokens], [seq_len], [table], block))
            for layer in range(layers):
                q, k, v = (torch.randn(num_tokens, h, dim, generator=generator).to(torch.bfloat16)
                           for h in (heads, kv_heads, kv_heads))
                out = backend.forward(q, k, v, *kv_caches[layer], meta, scale)
                history[layer] = [torch.cat((history[layer][0], k)), torch.cat((history[layer][1], v))]
                keys, values = (x.double().repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
                                for x in history[layer])
                scores = (q.double().transpose(0, 1) @ keys.transpose(1, 2)) * scale
                q_pos = torch.arange(seq_len - num_tokens, seq_len).unsqueeze(1)
                scores = scores.masked_fill(torch.arange(seq_len).unsqueeze(0) > q_pos, float("-inf"))
                want = (torch.softmax(scores, dim=-1) @ values).transpose(0, 1)
                assert out.dtype == torch.bfloat16
                worst = max(worst, float((out.double() - want).abs().max()))
        try:  # a call the lender cannot answer (no such loan): an error here, and the lender goes on
            lenders[0](0, "missing", 0, q, k, v, 1, scale).wait()
            result["refused"] = None
        except RuntimeError as error:
            result["refused"] = str(error)
        for lender in lenders:
            lender.stop()
        result.update(worst=worst, error=None, regions=sorted(regions._regions) if regions is not None else [])
    Path(out_dir, f"link{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()
