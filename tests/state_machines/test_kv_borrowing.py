"""Borrowing KV capacity across a replica set, its control plane in process: the controller's
placement from the mirrored pools (home, lenders, blocks each; refused when it fits nowhere), the
loans sent and returned, and a lender's scheduler and KV-cache manager reserving the blocks
(granted before its own admissions, never preempted, named in KV_LENT / KV_RETURNED), every
message through the wire codec."""

from __future__ import annotations

from typing import Any, cast

import pytest

from vllm_actors.actors.controller.controller import Controller, FromReplica
from vllm_actors.actors.controller.kv_loans import LoanPlanner, LoanRefused, Placement, spread
from vllm_actors.actors.controller.routing import Router
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig
from vllm_actors.protocol.errors import MessageRejected
from vllm_actors.protocol.events import Aborted, EventBatch, KvLent, KvPool, KvReturned, Routed
from vllm_actors.protocol.kv_loans import BorrowKv, LendKv, ReturnKv, loan_key
from vllm_actors.protocol.messages import (
    AbortRequests,
    AddRequest,
    ControlReply,
    EngineControl,
    NewRequest,
    RecoverPipeline,
    RequestUpdate,
    RequestUpdates,
    StepPlan,
    StepResult,
)
from vllm_actors.protocol.names import FRONTEND, KV_CACHE_MANAGER, SCHEDULER, WORKER, replica_actor
from vllm_actors.protocol.outputs import Outputs
from vllm_actors.protocol.sampling import SamplingParams

BLOCK = 16


def pool(num_blocks: int, num_free: int) -> KvPool:
    return KvPool(num_blocks=num_blocks, num_free=num_free, num_cached=0, num_cached_idle=0,
                  num_in_use=num_blocks - num_free)


def planner(*pools: tuple[int, int], keep_free: float = 0.1) -> LoanPlanner:
    loans = LoanPlanner(len(pools), BLOCK, max_model_len=1 << 20, keep_free=keep_free)
    for replica, (size, free) in enumerate(pools):
        loans.observe(replica, pool(size, free))
    return loans


# --------------------------------------------------------------------------- the placement
def test_a_request_that_fits_every_pool_is_left_to_the_router_and_an_unheard_pool_places_nothing() -> None:
    loans = planner((100, 100), (100, 100))
    assert loans.place("a", 100, [0, 1], [0, 0]) is None
    unheard = LoanPlanner(2, BLOCK, 1 << 20)
    unheard.observe(0, pool(100, 100))
    assert unheard.place("a", 500, [0, 1], [0, 0]) is None  # replica 1's pool not known yet


def test_the_home_is_the_largest_pool_and_the_fewest_lenders_most_free_first_share_it_evenly() -> None:
    loans = planner((100, 20), (100, 80), (100, 50), (120, 10))
    placement = loans.place("long", 250, [0, 1, 2, 3], [0, 0, 0, 0])
    # home: the largest pool (replica 3, share 120 - 12); lenders most free first, replica 1 (80 free) and 2 (50):
    # 108 + 90 + 90 hold 250 without replica 0; spread in proportion to the shares (250 / 288 of each)
    assert placement == Placement(home=3, home_blocks=94, lenders={1: 78, 2: 78})
    assert placement.num_blocks == 250
    assert loans.pools[1].promised == {"long": 78} and loans.pools[1].num_available == 2
    assert loans.pools[0].promised == {}


def test_fitting_the_largest_pool_needs_no_loan_and_short_free_blocks_are_asked_of_the_shares() -> None:
    loans = planner((100, 0), (60, 60))
    assert loans.place("mid", 80, [0, 1], [0, 0]) == Placement(home=0, home_blocks=80, lenders={})
    # nobody has free blocks to spare beyond replica 1's 60: the rest comes out of shares, most free first
    placement = loans.place("long", 140, [0, 1], [0, 0])
    assert placement == Placement(home=0, home_blocks=88, lenders={1: 52})  # shares 90 and 54
    assert loans.place("later", 140, [0, 1], [0, 0]) == Placement(0, 88, {1: 52})  # shares, not free: queued there


def test_a_request_that_fits_nowhere_even_borrowing_is_refused_by_name() -> None:
    loans = planner((100, 100), (100, 100))
    with pytest.raises(LoanRefused, match=r"'huge' needs 181 KV blocks \(2896 tokens\).*180 blocks"):
        loans.place("huge", 181, [0, 1], [0, 0])
    assert isinstance(LoanRefused("x"), ValueError)
    assert loans.place("fits", 180, [0, 1], [0, 0]) == Placement(0, 90, {1: 90})
    with pytest.raises(ValueError, match="keep_free"):
        LoanPlanner(2, BLOCK, 1024, keep_free=1.0)


def test_the_blocks_needed_are_the_whole_context_and_the_loans_follow_the_lenders_events() -> None:
    loans = planner((100, 100), (100, 100))
    assert loans.blocks_needed(1000, 0, 24) == 64  # ceil(1024 / 16)
    assert loans.blocks_needed(1000, 30, 24) == 65  # resumed with more outputs than max_tokens counts them
    assert loans.blocks_needed(1000, 0, None) == (1 << 20) // BLOCK  # up to max_model_len
    loans.place("long", 150, [0, 1], [0, 0])
    assert loans.pools[1].promised == {"long": 75}
    loans.observe(1, KvLent(request_id="long", block_ids=list(range(75)), num_free_blocks=25))
    assert loans.pools[1].lent == {"long": 75} and loans.pools[1].num_available == 25
    loans.pool_lost(1)  # a restarted KV-cache manager: its scheduler reserves them again
    assert loans.pools[1].promised == {"long": 75} and loans.pools[1].num_free == 100
    loans.observe(1, KvReturned(request_id="long", num_blocks=75, num_free_blocks=100))
    assert loans.release("long") == Placement(0, 75, {1: 75}) and loans.pools[1].promised == {}


# --------------------------------------------------------------------------- the controller
def add(request_id: str, num_tokens: int, max_tokens: int = 16) -> AddRequest:
    return AddRequest(request_id=request_id, prompt_token_ids=[1] * num_tokens,
                      params=SamplingParams(max_tokens=max_tokens), eos_token_ids=[0])


def heard(controller: Controller, replica: int, *events: Any) -> Outputs:
    topic = replica_actor(KV_CACHE_MANAGER, replica)
    return controller.observe(topic, EventBatch(actor=topic, first_seq=0, mono=0.0, wall=0.0, events=list(events)))


def lent(request_id: str, count: int) -> KvLent:
    return KvLent(request_id=request_id, block_ids=list(range(count)), num_free_blocks=0)


def borrowing_controller(policy: str = "round_robin") -> Controller:
    controller = Controller(Router(policy, 2, block_size=BLOCK), LoanPlanner(2, BLOCK, max_model_len=1 << 20))
    for replica in (0, 1):
        heard(controller, replica, pool(100, 100 - 30 * replica))
    return controller


def test_the_controller_lends_for_a_long_request_and_takes_the_loans_back_when_it_ends() -> None:
    controller = borrowing_controller()
    short = controller.handle(add("short", 40))
    assert [to for to, _ in short.messages] == ["scheduler@0"]  # fits: the router's pick
    out = controller.handle(add("long", 2400, max_tokens=80))  # 155 blocks: home 0 keeps 78, 1 lends 77
    assert out.messages == [("scheduler@1", LendKv(request_id="long", home=0, num_blocks=77))] and not out.events
    out = heard(controller, 1, lent("long", 77))  # held until the lender's KV_LENT
    assert out.messages[1][0] == "scheduler@0" and out.messages[1][1].request_id == "long"
    assert out.events == [Routed(request_id="long", replica=0, reason="borrowed")]
    assert controller.router.replicas[0].in_flight == 2
    finished = RequestUpdate(request_id="long", new_token_ids=[5], finish_reason="length")
    back = controller.handle(FromReplica(0, RequestUpdates(step_id=3, updates=[finished])))
    assert ("scheduler@1", ReturnKv(request_id="long")) in back.messages
    assert controller.loans is not None and controller.loans.placements == {}
    controller.handle(add("long2", 2400, max_tokens=80))
    heard(controller, 1, lent("long2", 77))
    # the lender's scheduler restarted: the loan it had granted is asked for again
    again = controller.handle(RecoverPipeline(actor="scheduler@1", reason="restarted"))
    assert again.messages == [("scheduler@1", LendKv(request_id="long2", home=0, num_blocks=77))]
    aborted = controller.handle(AbortRequests(request_ids=["long2"], reason="client"))
    assert [message for _, message in aborted.messages] == [
        AbortRequests(request_ids=["long2"], reason="client"), ReturnKv(request_id="long2")]


def test_the_controller_refuses_a_request_that_fits_nowhere_and_without_a_planner_routes_as_before() -> None:
    controller = borrowing_controller("pull")
    out = controller.handle(add("huge", 3000, max_tokens=10))  # 189 blocks, 180 in the shares
    ((to, updates),) = out.messages
    assert to == FRONTEND and updates.updates[0].finish_reason == "error"
    assert "needs 189 KV blocks" in updates.updates[0].error
    assert out.events == [Aborted(request_id="huge", reason="error")] and "huge" not in controller.requests
    controller.handle(add("long", 2400, max_tokens=80))  # pull: the home's slot is taken
    placed = heard(controller, 1, lent("long", 77))
    assert placed.messages[-1][0] == "scheduler@0" and list(controller.router.slots).count(0) == 255
    plain = Controller(Router("round_robin", 2, block_size=BLOCK))
    heard(plain, 0, pool(100, 100))
    assert [to for to, _ in plain.handle(add("long", 2400)).messages] == ["scheduler@0"]


# --------------------------------------------------------------------------- the lender
class Lender:
    """One replica's scheduler and KV-cache manager, every message through the codec, results faked
    (a token for each request sampled)."""

    def __init__(self, num_blocks: int = 16, max_model_len: int = 0) -> None:
        config = SchedulerConfig(max_model_len=max_model_len or num_blocks * BLOCK, max_num_seqs=8,
                                 max_num_batched_tokens=512, enable_chunked_prefill=True, block_size=BLOCK,
                                 num_blocks=num_blocks, max_steps_in_flight=1)
        self.scheduler = Scheduler(config)
        self.manager = KVCacheManager(num_blocks, BLOCK)
        self.codec = MessageCodec()
        self.kv_codec = MessageCodec.for_actor(KV_CACHE_MANAGER)
        self.plans: list[StepPlan] = []
        self.events: list[Any] = []
        self.pending: list[StepPlan] = []

    def send(self, message: Any) -> None:
        out = self.scheduler.handle(self.codec.decode(self.codec.encode(message)))
        self.events += out.events
        self.pending += [m for m in out.to(KV_CACHE_MANAGER) if isinstance(m, StepPlan)]

    def step(self) -> StepPlan:
        plan = self.pending.pop(0)
        out = self.manager.handle(cast(StepPlan, self.kv_codec.decode(self.codec.encode(plan))))
        self.events += out.events
        (forwarded,) = out.to(WORKER)
        self.plans.append(forwarded)
        sampled = [r for r in plan.req_ids if self.scheduler.requests.get(r) is not None
                   and self.scheduler.requests[r].num_pending]
        self.send(StepResult(step_id=plan.step_id, reset=plan.reset, req_ids=sampled, token_ids=[7] * len(sampled)))
        self.scheduler.ledger.check_invariants({r.request_id for r in self.scheduler.running}
                                               | self.scheduler.loans.ledger_keys())
        self.manager.check_invariants()
        return forwarded

    def until(self, done: Any) -> StepPlan:
        """Steps until one's forwarded plan satisfies ``done``."""
        while self.pending:
            plan = self.step()
            if done(plan):
                return plan
        raise AssertionError("no plan did")

    def of(self, kind: type) -> list[Any]:
        return [event for event in self.events if isinstance(event, kind)]


def test_a_lender_reserves_the_blocks_names_them_and_frees_them_when_the_loan_returns() -> None:
    lender = Lender()
    lender.send(add("own", 40, max_tokens=4))  # 3 blocks
    lender.step()
    lender.send(LendKv(request_id="guest", home=0, num_blocks=10))
    lender.send(LendKv(request_id="guest", home=0, num_blocks=10))  # a repeat is one loan
    plan = lender.until(lambda plan: plan.loans)
    assert plan.loans == {"guest": 10}
    (lent,) = lender.of(KvLent)
    assert lent.request_id == "guest" and len(lent.block_ids) == 10 and lender.manager.lent["guest"] == lent.block_ids
    assert not set(lent.block_ids) & {b for table in lender.manager.block_tables.values() for b in table}
    assert lender.scheduler.ledger.num_blocks(loan_key("guest")) == 10
    lender.send(ReturnKv(request_id="guest"))
    plan = lender.until(lambda plan: plan.returned_loans)
    assert plan.returned_loans == ["guest"] and lender.manager.lent == {}
    (returned,) = lender.of(KvReturned)
    assert returned.num_blocks == 10
    lender.send(ReturnKv(request_id="guest"))  # late: nothing to free
    assert not lender.scheduler.loans.has_news


def test_a_loan_waits_for_blocks_ahead_of_new_requests_and_is_never_preempted_for_the_lenders_own() -> None:
    lender = Lender(num_blocks=16)
    lender.send(add("a", 150, max_tokens=40))  # 10 blocks now, 12 at the end
    lender.step()
    lender.send(LendKv(request_id="guest", home=1, num_blocks=8))  # 6 free: it waits
    lender.send(add("b", 20, max_tokens=2))  # waits behind the loan
    lender.step()
    assert lender.scheduler.loans.pending == {"guest": 8}
    assert "b" not in {request.request_id for request in lender.scheduler.running}
    while lender.scheduler.loans.pending:  # "a" decodes to its end; then the loan takes its blocks
        lender.step()
    assert lender.scheduler.loans.granted == {"guest": 8}
    while lender.pending:  # "b" runs beside the loan to its end
        lender.step()
    assert "b" not in lender.scheduler.requests and lender.manager.lent.keys() == {"guest"}
    # A request needing more than the loan leaves: it preempts itself, never the loan
    lender.send(add("c", 120, max_tokens=40))  # 8 blocks free, it grows to 10
    for _ in range(60):
        if not lender.pending:
            break
        lender.step()
    assert lender.scheduler.stats.num_preemptions > 0 and lender.scheduler.loans.granted == {"guest": 8}
    assert len(lender.manager.lent["guest"]) == 8


def test_a_pipeline_reset_reserves_the_loans_again_and_the_manager_refuses_a_bad_loan() -> None:
    lender = Lender()
    lender.send(LendKv(request_id="guest", home=0, num_blocks=4))
    lender.step()
    lender.send(RecoverPipeline(actor="kv_cache_manager", reason="restarted"))
    plan = lender.step()
    assert plan.reset and plan.loans == {"guest": 4} and len(lender.manager.lent["guest"]) == 4
    assert [type(e) for e in lender.events if isinstance(e, (KvLent, KvReturned))] == [KvLent, KvReturned, KvLent]
    manager = KVCacheManager(8, BLOCK)
    with pytest.raises(MessageRejected, match="never lent"):
        manager.assign_blocks(StepPlan(step_id=1, returned_loans=["nobody"]))
    with pytest.raises(MessageRejected, match="needs 9 blocks"):
        manager.assign_blocks(StepPlan(step_id=1, loans={"guest": 9}))
    with pytest.raises(ValueError, match="at least 1"):
        lender.send(LendKv(request_id="x", home=0, num_blocks=0))


# --------------------------------------------------------------------------- the home
def test_the_home_gets_the_request_once_its_lenders_confirmed_and_learns_them_right_before_it() -> None:
    controller = borrowing_controller()
    controller.handle(add("long", 2400, max_tokens=80))
    assert not heard(controller, 0, lent("long", 77)).messages  # not its lender: still held
    out = heard(controller, 1, lent("long", 77))
    assert out.messages == [("scheduler@0", BorrowKv(request_id="long", lenders=[[1, 77]])),
                            ("scheduler@0", add("long", 2400, max_tokens=80))]
    assert not heard(controller, 1, lent("long", 77)).messages  # a repeat (a re-grant) sends nothing
    controller.handle(add("held", 2400, max_tokens=80))
    dropped = controller.handle(AbortRequests(request_ids=["held"], reason="client"))  # aborted while held
    assert [m for _, m in dropped.messages] == [ReturnKv(request_id="held")] and "held" not in controller.held
    again = controller.handle(RecoverPipeline(actor="scheduler@0", reason="restarted"))
    assert [(to, type(message)) for to, message in again.messages] == [("scheduler@0", BorrowKv),
                                                                      ("scheduler@0", AddRequest)]


def test_a_guest_is_admitted_beyond_the_homes_pool_holding_only_its_own_blocks_and_never_cached() -> None:
    home = Lender(num_blocks=16, max_model_len=1 << 12)  # kv_borrowing: the model's limit, not the pool's
    refused = home.scheduler.handle(add("too_long", 300))  # 19 blocks, no loan: refused by the pool
    (update,) = refused.to(FRONTEND)[0].updates
    home.pending += [m for m in refused.to(KV_CACHE_MANAGER) if isinstance(m, StepPlan)]  # the reset plan
    assert update.finish_reason == "error" and "more than this replica's KV pool holds (256)" in update.error
    home.send(BorrowKv(request_id="long", lenders=[[1, 10], [2, 5]]))
    home.send(add("long", 400, max_tokens=3))  # 25 blocks (26 with its outputs): 15 lent, the rest here
    first = home.until(lambda plan: plan.req_ids)
    assert first.new_requests[0].borrowed == [[1, 10], [2, 5]]
    assert first.num_blocks == [10] and not first.cached_hashes  # ceil(400 / 16) - 15, none cached
    home.until(lambda plan: not plan.req_ids)
    assert [u.request_id for u in home.of(Aborted)] == [] and home.scheduler.requests == {}
    lender = Lender()
    lender.send(LendKv(request_id="long", home=0, num_blocks=4))
    plan = lender.step()
    assert plan.lent_block_ids == {"long": lender.manager.lent["long"]} and len(plan.lent_block_ids["long"]) == 4


@pytest.mark.parametrize(("fields", "match"), [
    ({"data_parallel_size": 1}, "needs data_parallel_size > 1"),
    ({"tensor_parallel_size": 2}, "tensor_parallel_size 2 is not supported"),
    ({"kv_parallel_size": 2}, "kv_parallel_size 2 is not supported"),
    ({"distributed_executor_backend": "ray"}, "use 'mp'"),
    ({"kv_cache_dtype": "fp8"}, "fp8 KV cache"),
    ({"disable_events": True}, "needs the KV-cache managers' events"),
])
def test_kv_borrowing_is_off_by_default_and_refused_where_unsupported(fields: dict[str, Any], match: str) -> None:
    assert not EngineConfig(model="m").kv_borrowing
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="m", kv_borrowing=True, **({"data_parallel_size": 2} | fields))


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "auto", "cpu"])
def test_kv_borrowing_takes_a_gpu_device(device: str) -> None:
    """One GPU per replica (their workers' gloo group staged through pinned memory): the config no
    longer refuses a CUDA device; checked without one (the config touches no device)."""
    config = EngineConfig(model="m", kv_borrowing=True, data_parallel_size=2, device=device)
    assert config.kv_borrowing and config.device == device


def test_the_kv_borrowing_flag_reaches_the_engine_off_by_default() -> None:
    from vllm_actors.cli import build_parser, engine_kwargs

    parser = build_parser()
    assert engine_kwargs(parser.parse_args(["serve", "some/model"]))["kv_borrowing"] is False
    assert engine_kwargs(parser.parse_args(["serve", "some/model", "-dp", "2", "--kv-borrowing"]))["kv_borrowing"]


def test_the_worker_runs_a_step_with_a_guest_eagerly_and_the_others_as_before() -> None:
    """A step whose batch holds a borrowing request is marked ``eager`` (its attention calls out to
    the lenders: no CUDA graph); a step without one is not, the guest's row opened with placeholders
    where the lenders' blocks sit."""
    import torch

    from tests.support.fake_runner import FakeRunner
    from vllm_actors.actors.worker.worker import Worker
    from vllm_actors.kernels.attention import TorchPagedAttention
    from vllm_actors.models.kv_borrow import BorrowingAttention, LenderShare
    from vllm_actors.protocol.token_ids import pack_token_ids
    from vllm_actors.runner.kv_borrowing import KvBorrowing
    from vllm_actors.runner.sampler import Sampler

    runner = FakeRunner(num_blocks=8, block_size=4)
    worker = Worker(runner, Sampler(torch.device("cpu")), clock=lambda: 0.0)
    worker.borrowing = KvBorrowing(BorrowingAttention(TorchPagedAttention(), 4), LenderShare([]), {1: print})

    def new(request_id: str, borrowed: list[list[int]]) -> NewRequest:
        return NewRequest(request_id=request_id, token_ids=pack_token_ids([5, 6, 7]), num_prompt_tokens=3,
                          num_output_tokens=0, params=SamplingParams(temperature=0.0, max_tokens=4),
                          eos_token_ids=[], borrowed=borrowed)

    worker.handle(StepPlan(step_id=0, new_requests=[new("short", [])], req_ids=["short"], num_tokens=[3],
                           num_blocks=[1], new_block_ids=[[3]]))
    assert runner.batches[-1].eager is False
    worker.handle(StepPlan(step_id=1, new_requests=[new("long", [[1, 2]])], req_ids=["long", "short"],
                           num_tokens=[3, 1], num_blocks=[0, 1], new_block_ids=[[], []]))
    assert runner.batches[-1].eager is True and worker.requests["long"].block_table == [0, 0]
    worker.handle(StepPlan(step_id=2, req_ids=["short"], num_tokens=[1], num_blocks=[2], new_block_ids=[[4]],
                           finished_ids=["long"]))
    assert runner.batches[-1].eager is False
    (reply,) = worker.control(EngineControl(control_id="c", action="sleep", level=1)).to(SCHEDULER)
    assert isinstance(reply, ControlReply) and not reply.success and "kv_borrowing" in (reply.error or "")
    assert "short" in worker.requests  # refused before anything was dropped


def test_a_spread_is_proportional_to_the_shares_sums_exactly_and_stays_within_them() -> None:
    assert spread(250, [108, 90, 90]) == [94, 78, 78]
    assert spread(155, [90, 90]) == [78, 77]  # a tie's extra block goes to the earlier (the home)
    for num_blocks in range(289):
        counts = spread(num_blocks, [108, 90, 90])
        assert sum(counts) == num_blocks and all(c <= s for c, s in zip(counts, [108, 90, 90], strict=True))
