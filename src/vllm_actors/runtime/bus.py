"""The event bus: an XSUB/XPUB proxy. Actors publish into XSUB; subscribers read XPUB."""

from __future__ import annotations

import threading

import zmq

from vllm_actors.runtime.process import ActorSpec, report
from vllm_actors.runtime.zmq_shell import EVENT_HWM


def run_bus(spec: ActorSpec, context: zmq.Context, stop: threading.Event) -> None:
    """The event bus: an XSUB/XPUB proxy. Actors publish into XSUB; subscribers read XPUB."""
    frontend = context.socket(zmq.XSUB)
    backend = context.socket(zmq.XPUB)
    for socket in (frontend, backend):
        socket.setsockopt(zmq.SNDHWM, EVENT_HWM)
        socket.setsockopt(zmq.RCVHWM, EVENT_HWM)
        socket.setsockopt(zmq.LINGER, 0)
    frontend.bind(spec.addresses.bus_in)
    backend.bind(spec.addresses.bus_out)
    control = context.socket(zmq.PAIR)
    control.bind("inproc://bus-control")
    terminator = context.socket(zmq.PAIR)
    terminator.connect("inproc://bus-control")

    def terminate_on_stop() -> None:
        stop.wait()
        terminator.send(b"TERMINATE")

    threading.Thread(target=terminate_on_stop, daemon=True).start()
    report("ready", info={})
    zmq.proxy_steerable(frontend, backend, None, control)
    for socket in (frontend, backend, control, terminator):
        socket.close()
