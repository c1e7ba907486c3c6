"""The engine in one process: the actors wired through the in-memory transport.

The same state machines run as separate processes over ZMQ; here a round-robin loop delivers
their messages, each actor through the same loop core as a process's shell (``runtime/loop.py``)
with its role's accept rules and client screening (``runtime/roles.py``). The frontend is the
client's own (``ClientCore``): its inbox is read by the same loop and its outputs come back from
``step``/``poll``. Used by tests and as the offline engine's in-process mode.
"""

from __future__ import annotations

import tempfile
import weakref
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_actors.actors.frontend.frontend import Frontend
from vllm_actors.actors.frontend.outputs import RequestOutput
from vllm_actors.actors.kv_cache_manager.manager import KVCacheManager
from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.actors.scheduler.scheduler import Scheduler
from vllm_actors.actors.worker.worker import Worker
from vllm_actors.clients.core import SyncClient
from vllm_actors.envs import envs
from vllm_actors.models.config import ModelConfig
from vllm_actors.protocol.config import EngineConfig, SchedulerConfig, resolve_scheduler_config
from vllm_actors.protocol.events import EventBatch
from vllm_actors.protocol.messages import Message, RecoverPipeline, StepPlan, StepResult
from vllm_actors.protocol.metrics import DumpQuery, MetricsQuery, MetricsReply
from vllm_actors.runtime.loop import ActorLoop
from vllm_actors.runtime.roles import role_of
from vllm_actors.runtime.transport import Actor, EventStamper, InMemoryEndpoint, InMemoryNetwork

if TYPE_CHECKING:
    from vllm_actors.actors.frontend.tokenizer import Tokenizer


class InMemoryTransport:
    """An actor's side of the in-memory network (the frontend's, each engine actor's): messages
    through its endpoint, events stamped and handed to the engine's bus listeners."""

    def __init__(self, endpoint: InMemoryEndpoint, publish_batch: Callable[[EventBatch], None]) -> None:
        self.endpoint = endpoint
        self.stamper = EventStamper(endpoint.name)
        self._publish_batch = publish_batch

    def publish(self, events: list[Any]) -> None:
        self._publish_batch(self.stamper.stamp(events))

    def send(self, destination: str, message: Message) -> None:
        self.endpoint.send(destination, message)


class InProcessEngine(SyncClient):
    # Every live engine, so that tests can check the KV invariants of all of them after each test.
    live: weakref.WeakSet[InProcessEngine] = weakref.WeakSet()

    def __init__(
        self,
        config: EngineConfig,
        serialize: bool = False,
        runner: Any = None,
        tokenizer: Tokenizer | None | str = "load",
    ) -> None:
        """``runner`` and ``tokenizer`` may be injected (tests); by default the model runner
        loads ``config.model`` and the tokenizer comes from the same path."""
        from vllm_actors.runner.build import build_worker  # torch lives behind these imports

        self.config = config
        if config.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 needs the process executor (one process per rank); "
                             "the in-process engine runs one worker")
        if config.pipeline_parallel_size > 1:
            raise ValueError("pipeline_parallel_size > 1 needs the process executor (one process per stage); "
                             "the in-process engine runs one worker")
        if config.kv_parallel_size > 1:
            raise ValueError("kv_parallel_size > 1 needs the process executor (one process per rank); "
                             "the in-process engine runs one worker")
        if runner is None:
            from vllm_actors.runner.model_runner import ModelRunner

            runner = ModelRunner(config)
        self.model_config: ModelConfig = runner.model_config
        if tokenizer == "load":
            from vllm_actors.actors.frontend.tokenizer import load_tokenizer

            tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.tokenizer or config.model)
        from vllm_actors.runner.build import wave_tokens  # torch: imported where the runner is

        self.scheduler_config: SchedulerConfig = resolve_scheduler_config(
            config, self.model_config.derived_max_model_len, runner.num_blocks,
            vocab_size=self.model_config.vocab_size,
            allow_long_max_model_len=envs.VLLM_ACTORS_ALLOW_LONG_MAX_MODEL_LEN,
            num_host_blocks=getattr(runner, "num_host_blocks", 0), attention_wave_tokens=wave_tokens(runner),
        )
        frontend = Frontend(
            tokenizer,  # type: ignore[arg-type]
            self.model_config.eos_token_ids,
            self.scheduler_config.max_model_len,
            self.model_config.vocab_size,
        )
        self.scheduler = Scheduler(self.scheduler_config)
        self.kv_cache_manager = KVCacheManager(runner.num_blocks, config.block_size,
                                               self.scheduler_config.num_host_blocks)
        self.worker, _ = build_worker(config, runner=runner)
        self._network = InMemoryNetwork(serialize=serialize)
        self._frontend_endpoint = self._network.endpoint(frontend.name)
        super().__init__(frontend, InMemoryTransport(self._frontend_endpoint, self._publish), frontend.name)
        # One loop per actor, as each runs in its process: its role's identity, accept rules and,
        # where clients connect, request-identity screening (the frontend is the client).
        self._transports: dict[str, InMemoryTransport] = {}
        self._loops: list[ActorLoop] = []
        for actor in (self.scheduler, self.kv_cache_manager, self.worker):
            endpoint = self._network.endpoint(actor.name, identity=role_of(actor.name).actor_id(None))
            self._transports[actor.name] = InMemoryTransport(endpoint, self._publish)
            self._loops.append(self._loop(actor, restarted=False))
        self.step_hooks: list[Callable[[InProcessEngine], None]] = []
        # Subscribers of the in-process event bus: the metrics store, tests.
        from vllm_actors.actors.metrics_store.store import MetricsStore
        from vllm_actors.runtime.metrics_shell import record_logged

        self.metrics_store = MetricsStore()
        self._dump_dir: Path | None = None  # made (private) at the first DumpQuery
        self.event_listeners: list[Callable[[EventBatch], None]] = [partial(record_logged, self.metrics_store)]
        InProcessEngine.live.add(self)
        if config.check_invariants or envs.VLLM_ACTORS_CHECK_INVARIANTS:
            self.step_hooks.append(InProcessEngine.check_invariants)

    def _publish(self, batch: EventBatch) -> None:
        for listener in self.event_listeners:
            listener(batch)

    # ------------------------------------------------------------------ running
    def step(self) -> list[RequestOutput]:
        """Deliver messages until one worker step has completed (or nothing is left to do);
        return the client outputs that came out of it."""
        outputs: list[RequestOutput] = []
        while True:
            update = self._frontend_endpoint.recv()
            progressed = update is not None
            if update is not None:
                outputs.extend(self._receive_any(update))
            stepped = False
            for loop in self._loops:
                message = loop.endpoint.recv()
                if message is not None:
                    sent = loop.receive(loop.endpoint.last_sender, message)
                elif loop.has_pending():
                    sent = loop.flush()  # as the shell does: a launched step is read back once no message waits
                else:
                    continue
                progressed = True
                if sent is not None and any(isinstance(outgoing, StepResult) for _, outgoing in sent.messages):
                    stepped = True
            if stepped:
                for hook in self.step_hooks:
                    hook(self)
            if stepped or not progressed:
                return outputs

    def poll(self, timeout_ms: int = 0) -> list[RequestOutput]:
        """The client interface: one step's outputs (nothing to wait for in process)."""
        outputs = self._with_held(self.step())
        if not self.has_unfinished:
            outputs.extend(self.run_until_idle())  # let the scheduler hand the last blocks back
        return outputs

    def query_metrics(self, query: MetricsQuery) -> MetricsReply:
        from vllm_actors.runtime.metrics_shell import answer

        if self._dump_dir is None and isinstance(query, DumpQuery):
            self._dump_dir = Path(tempfile.mkdtemp(prefix="vllm-actors-dumps-"))
        return answer(self.metrics_store, query, self._dump_dir or Path())  # writes the file of a DumpQuery there

    def run_until_idle(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        while self._network.pending() or any(loop.has_pending() for loop in self._loops):
            outputs.extend(self.step())
        return outputs

    # ------------------------------------------------------------------ faults (tests)
    def _loop(self, actor: Actor, restarted: bool) -> ActorLoop:
        """An actor's loop: in process a rejection is a bug the test should see, except by a
        restarted actor, which meets plans made before its restart (until the scheduler's reset
        plan) and drops each, with REJECTED, as the shell does."""
        role = role_of(actor.name)
        transport = self._transports[actor.name]
        owners = RequestOwners() if role.clients_connect else None  # a restarted shell starts with none
        return ActorLoop(actor, transport.endpoint, transport, role.accepts(None, 0), owners=owners,
                         raise_rejections=not restarted)

    def replace_actor(self, actor: Scheduler | KVCacheManager | Worker) -> None:
        """Put a fresh ``actor`` in the place of the one of its name, as the supervisor restarts a
        crashed process: the messages queued for the old one die with it, and so does its shell's
        state (a scheduler's request owners); the new one's rejections (plans made before its
        restart) are dropped with REJECTED, as by the shell. Recovery is then up to the caller
        (``RecoverPipeline`` to the scheduler, or the clients' resubmissions)."""
        for index, loop in enumerate(self._loops):
            if loop.actor.name == actor.name:
                while loop.endpoint.recv() is not None:
                    pass
                self._loops[index] = self._loop(actor, restarted=True)
                setattr(self, actor.name, actor)
                return
        raise ValueError(f"no actor named {actor.name!r}")

    def receive_pending(self) -> list[RequestOutput]:
        """The outputs of the updates already queued for the client (what it has received once
        a dead scheduler's last messages are in), without running any actor."""
        outputs: list[RequestOutput] = []
        while (update := self._frontend_endpoint.recv()) is not None:
            outputs.extend(self._receive_any(update))
        return outputs

    def inject(self, destination: str, message: Message, first: bool = False, *, sender: str | None = None) -> None:
        """Queue ``message`` for an actor as if ``sender`` had sent it (default: this client, the
        frontend; ``SUPERVISOR`` for what the supervisor sends); ``first`` puts it ahead of what
        is already queued there."""
        self._network.post(self._frontend_endpoint.identity if sender is None else sender.encode(),
                           destination, message)
        if first:
            inbox = self._network.inbox(destination)
            inbox.appendleft(inbox.pop())

    # ------------------------------------------------------------------ checks
    def _resetting(self) -> bool:
        """A pipeline reset the KV-cache manager has not applied yet: the scheduler has not sent
        the reset plan, or it is still queued for the manager, or the scheduler has yet to learn of
        a restart (a ``RecoverPipeline`` queued for it: a fresh manager may have taken a plan made
        for its predecessor)."""
        queued = self._network.inbox(self.kv_cache_manager.name)
        recovering = any(isinstance(m, RecoverPipeline) for _, m in self._network.inbox(self.scheduler.name))
        return (self.scheduler.reset_pending or recovering
                or any(isinstance(m, StepPlan) and m.reset for _, m in queued))

    def check_idle_invariants(self) -> None:
        """Once nothing is unfinished: no table is left and every block is free or idle in the
        prefix cache."""
        self.run_until_idle()
        self.check_invariants()
        manager = self.kv_cache_manager
        idle = manager.num_idle_cached_blocks
        if manager.block_tables or manager.num_free_blocks + idle != manager.pool.num_blocks:
            raise AssertionError(
                f"idle engine holds blocks: tables of {sorted(manager.block_tables)}, "
                f"{manager.num_free_blocks} free + {idle} idle cached of {manager.pool.num_blocks}"
            )

    def check_invariants(self) -> None:
        """The scheduler's ledger and the KV manager each add up (free + cached + private ==
        total, references match holders, no block held for a request the scheduler no longer
        runs beyond the ones it frees in its next plan), and the two agree on every count."""
        live = {request.request_id for request in self.scheduler.running}
        pending = set(self.scheduler.departed)
        manager = self.kv_cache_manager
        ledger = self.scheduler.ledger
        ledger.check_invariants(live)
        if self._resetting():  # the manager still holds what the reset plan will drop
            manager.check_invariants()
            return
        queued = [m for _, m in self._network.inbox(manager.name) if isinstance(m, StepPlan)]
        for plan in queued:  # made but not applied yet: they free what they name
            pending.update(plan.finished_ids)
        manager.check_invariants(live | pending)
        trimming = self.scheduler.spec is not None and self.scheduler.spec.has_trims  # the next plan gives blocks back
        if not pending and not queued and not trimming:  # the KV manager has applied every plan made so far
            ours = (ledger.num_free, ledger.num_cached, ledger.cache.num_evictable if ledger.cache else 0)
            theirs = (manager.num_free_blocks, len(manager.cached), manager.num_idle_cached_blocks)
            if ours != theirs:
                raise AssertionError(
                    f"free, cached, idle blocks: the scheduler counts {ours}, the KV manager {theirs}"
                )
            host = set(ledger.host.blocks) if ledger.host is not None else set()
            backups = set(ledger.host.backups) if ledger.host is not None else set()
            if host != set(manager.host.entries) or backups != set(manager.host.backups):
                raise AssertionError(f"the host tier: the scheduler holds {len(host)} blocks and {len(backups)} "
                                     f"backups, the KV manager {len(manager.host.entries)} and "
                                     f"{len(manager.host.backups)}, not the same ones")
