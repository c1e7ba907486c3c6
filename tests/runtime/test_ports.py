"""The TCP ports of a group stay held from the choice of its addresses until it stops
(runtime/ports.py): CI at 1a55c8c lost a Ray host to a port taken between its probe and its bind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from vllm_actors.runtime.ports import PortReservation
from vllm_actors.runtime.run_dir import make_addresses

HOST = "127.0.0.1"


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((HOST, port))
        except OSError:
            return False
        return True


def test_a_held_port_is_refused_to_others_but_its_actor_binds_it_and_rebinds_after_a_restart() -> None:
    held = PortReservation(HOST)
    (port,) = held.take(1)
    other = PortReservation(HOST)
    try:
        assert not _bindable(port)
        assert port not in other.take(64)
        for _ in range(2):  # the actor, then the actor restarted (a new process: a new context)
            # A context per life: ``close`` only asks ZMQ's I/O thread to close the socket, and a
            # bind right after it in the same context could find the port still in use; ``term``
            # returns once every socket is closed. (Once, the second bind failed that way and the
            # unclosed socket then held ``term`` until the suite's timeout.)
            context = zmq.Context()
            router = context.socket(zmq.ROUTER)
            try:
                router.bind(f"tcp://{HOST}:{port}")
                assert not _bindable(port)
            finally:
                router.close(linger=0)
                context.term()
        assert not _bindable(port)  # still held between the actor's lives
    finally:
        held.close()
        other.close()
    assert held.closed
    assert _bindable(port)
    with pytest.raises(RuntimeError, match="closed"):
        held.take(1)


def test_tcp_addresses_use_distinct_held_ports(tmp_path: Path) -> None:
    held = PortReservation(HOST)
    try:
        addresses = make_addresses(tmp_path, 2, HOST, num_replicas=2, ports=held)
        endpoints = [addresses.bus_in, addresses.bus_out, addresses.metrics, addresses.scheduler,
                     *addresses.bus_in_actors.values(),
                     *(a for replica in addresses.replicas for a in (replica.scheduler, replica.kv_cache_manager,
                                                                     *replica.workers))]
        ports = [int(endpoint.rsplit(":", 1)[1]) for endpoint in endpoints]
        assert len(set(ports)) == len(ports)
        assert sorted(ports) == sorted(held.ports)
        assert not any(_bindable(port) for port in ports)
        with pytest.raises(ValueError, match="not on"):
            make_addresses(tmp_path, 1, "0.0.0.0", ports=held)
    finally:
        held.close()
