"""One actor process: ``python -m vllm_actors.runtime.actor_main SPEC_JSON``.

Started by the supervisor in a fresh interpreter; ``runtime/process.py`` holds the contract with
it (spec, readiness line, parent watch, signals). Here: build the role's state machine from its
entry in ``roles.ROLES``, wrap it in its shell (``zmq_shell.ActorShell``, the controller's
``controller_shell.ControllerShell``; the bus and the metrics store have their own process bodies
in ``bus.py`` and ``metrics_shell.py``), serve until stopped. SIGTERM or SIGINT: publish
DRAINING/STOPPED and exit 0; a state machine's bug: publish CRASHED and exit 1.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Callable

import msgspec
import structlog
import zmq

from vllm_actors.actors.controller.controller import Controller
from vllm_actors.actors.scheduler.owners import RequestOwners
from vllm_actors.envs import envs
from vllm_actors.protocol.codec import MessageCodec
from vllm_actors.protocol.events import (
    ActorDraining,
    ActorReady,
    ActorStarting,
    ActorStopped,
    Heartbeat,
)
from vllm_actors.protocol.names import BUS, METRICS
from vllm_actors.runtime.bus import run_bus
from vllm_actors.runtime.busy_poll import busy_poll_seconds
from vllm_actors.runtime.controller_shell import ControllerShell
from vllm_actors.runtime.log_setup import configure_logging
from vllm_actors.runtime.metrics_shell import run_metrics
from vllm_actors.runtime.process import (
    READY_TIMEOUT,
    ActorSpec,
    install_signal_handlers,
    report,
    set_busy_source,
    watch_parent,
)
from vllm_actors.runtime.roles import role_of
from vllm_actors.runtime.security import GroupKeys, authenticating, keys_for
from vllm_actors.runtime.zmq_shell import ActorShell, EventPublisher, wait_until_seen

log = structlog.get_logger(__name__)

RESTART_SEEN_TIMEOUT = 3.0  # seconds a restarted actor waits for the metrics store to see it

# What each role's process runs: an engine actor's shell, or the bus's and metrics store's own.
ProcessBody = Callable[[ActorSpec, zmq.Context, threading.Event, GroupKeys | None], None]


def run_engine_actor(spec: ActorSpec, context: zmq.Context, stop: threading.Event,
                     keys: GroupKeys | None = None) -> None:
    role = role_of(spec.role)
    # The engine actors publish no work events (to measure what they cost); the environment name is
    # the field's deprecated alias.
    drop_work_events = spec.engine.disable_events or envs.VLLM_ACTORS_DISABLE_EVENTS
    publisher_for_start = EventPublisher.for_actor(context, spec.addresses, spec.actor_id, keys,
                                                   drop_work_events=drop_work_events)
    pid = os.getpid()
    publisher_for_start.publish([ActorStarting(pid=pid, role=spec.role)])
    built = role.build(spec)
    inbox = role.inbox(spec)
    bus_in = spec.addresses.publish_address(spec.actor_id)  # its own endpoint: the bus forwards only its id there
    codec = MessageCodec.for_actor(spec.role)
    owners = RequestOwners() if role.clients_connect else None
    peers, accepts = role.peers(spec), role.accepts(spec.replica, spec.engine.answering_rank)
    shell: ActorShell
    if role.follows_bus:
        if not isinstance(built.actor, Controller):
            raise TypeError(f"the {spec.role} role follows the bus: its actor must be the controller")
        shell = ControllerShell(context, built.actor, spec.actor_id, inbox, bus_in, peers, accepts, codec,
                                keys=keys, owners=owners, drop_work_events=drop_work_events,
                                bus_out=spec.addresses.bus_out, remote_replicas=spec.remote_replicas)
    else:
        shell = ActorShell(context, built.actor, spec.actor_id, inbox, bus_in, peers, accepts, codec, keys=keys,
                           owners=owners, drop_work_events=drop_work_events)
    shell.publisher.stamper = publisher_for_start.stamper  # one sequence per actor
    shell.busy_poll_s = busy_poll_seconds(spec.engine.device)
    publisher_for_start.close()
    try:
        # A first start waits until the metrics store sees this actor's events (nothing is lost to
        # the slow-joiner problem). A restart must not depend on the store, which may itself be
        # down or hung: it waits briefly, then serves anyway (the store counts what it missed).
        try:
            seen_timeout = READY_TIMEOUT if spec.incarnation == 0 else RESTART_SEEN_TIMEOUT
            wait_until_seen(shell.publisher, context, spec.addresses.metrics, spec.actor_id, seen_timeout,
                            lambda: Heartbeat(pid=pid), keys)
        except TimeoutError:
            if spec.incarnation == 0:
                raise
            log.warning("the metrics store does not see this restarted actor; serving anyway", actor=spec.actor_id)
        shell.publisher.publish([ActorReady(pid=pid, role=spec.role)])
        set_busy_source(shell.busy_seconds)  # the liveness pings report how long a message takes
        report("ready", info=built.info)
        shell.run(stop)  # a bug publishes CRASHED and propagates: main() exits non-zero
        shell.publisher.publish([ActorDraining(reason="stop"), ActorStopped(reason="stop")])
    finally:
        shell.close()


PROCESS_BODIES: dict[str, ProcessBody] = {BUS: run_bus, METRICS: run_metrics}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_logging()
    spec = msgspec.json.decode(argv[0].encode(), type=ActorSpec)
    structlog.contextvars.bind_contextvars(actor=spec.actor_id)
    stop = threading.Event()
    watch_parent(stop)
    install_signal_handlers(stop)
    context = zmq.Context()
    try:
        keys = keys_for(spec.addresses, spec.run_dir)  # TCP: the group's CURVE keys, from the run directory
        with authenticating(context, keys):
            PROCESS_BODIES.get(spec.role, run_engine_actor)(spec, context, stop, keys)
    except Exception as error:
        log.error("actor failed", exc_info=error)  # one line; the traceback at DEBUG
        report("error", error=f"{type(error).__name__}: {error}")
        return 1
    finally:
        context.term()
    return 0


def exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: ``main`` has closed the sockets and the context,
    and tearing down torch and the grammar library took a worker about a second after every stop,
    which held up each shutdown of the group. Logs and pipes are flushed first."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
