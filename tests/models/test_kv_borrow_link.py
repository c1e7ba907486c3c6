"""Borrowed KV between processes, the link alone (``models/kv_borrow_link.py``): q, k and v packed
once a layer for every lender, tensors travelling as their bytes (bfloat16 too), and the host
staging that is an identity on the CPU; then three processes over gloo, a home asking two lenders
at every layer of two, bfloat16 K/V: the merged output is causal attention over the whole context.
The lenders' threads wait on the exchange group past the timeout of a group that gives up on an idle
receive (as the world's did), and a call a lender cannot answer is an error at the home."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.kv_borrow_ranks import LINK_CHUNKS, run_link_rank
from vllm_actors.models.kv_borrow_link import GLOO, QkvStaging, as_bytes, host_buffer, to_device, to_host, unpack
from vllm_actors.runtime.shm_regions import SHM_FOLDER, region_prefix


def test_qkv_reach_the_host_packed_once_for_every_lender() -> None:
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 8, 16, generator=generator).to(torch.bfloat16)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]  # views, as the model's projections are
    staging = QkvStaging()
    packed, where = staging.packed(q, k, v)
    assert packed.is_contiguous() and torch.equal(packed, qkv) and where == GLOO
    assert staging.packed(q, k, v)[0] is packed  # the second lender of the layer: no second copy
    assert staging.packed(q.clone(), k, v)[0] is not packed
    assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(unpack(packed, 4, 2), (q, k, v), strict=True))


def test_tensors_travel_as_their_bytes_and_the_cpu_stages_nothing() -> None:
    x = torch.randn(3, 4, 17).to(torch.bfloat16)
    received = host_buffer((3, 4, 17), torch.bfloat16, torch.device("cpu"))
    assert not received.is_pinned()
    as_bytes(received).copy_(as_bytes(x))  # what gloo does with a message
    assert torch.equal(received, x) and as_bytes(x).numel() == x.numel() * 2
    assert to_host(x) is x and to_device(x, torch.device("cpu")) is x


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_home_asks_two_lenders_over_gloo_at_every_layer(tmp_path: Path, transport: str) -> None:
    """``shm``: q, k, v and the answers in shared regions where a chunk fits (4 tokens), over gloo where not."""
    import torch.multiprocessing as mp

    mp.start_processes(run_link_rank, args=(str(tmp_path / "store"), str(tmp_path), transport), nprocs=3,
                       start_method="spawn")
    home, *lenders = [json.loads((tmp_path / f"link{rank}.json").read_text()) for rank in range(3)]
    prefix = region_prefix(tmp_path)
    if transport == "shm":  # each wrote its own region and read the others': all gone with their writers
        assert home["regions"] == [f"{prefix}-q0", f"{prefix}-r0-1", f"{prefix}-r0-2"]
        assert lenders[0]["regions"] == [f"{prefix}-q0", f"{prefix}-r0-1"]
    assert not list(SHM_FOLDER.glob(prefix + "-*"))
    assert home["error"] is None and lenders[1]["error"] is None
    assert "no blocks lent for request 'missing'" in lenders[0]["error"]  # logged; its thread went on to STOP
    assert home["worst"] < 2e-2  # bfloat16 outputs
    # every layer of every step asks both lenders, a share without any key of theirs yet included
    assert [lender["calls"] for lender in lenders] == [2 * len(LINK_CHUNKS) + 1, 2 * len(LINK_CHUNKS)]  # + "missing"
    # idle on the exchange group longer than a short group's timeout, the lenders' threads still answered
    assert home["short_recv_failed"]
    # a call the lender could not answer: an error at the home, not a wait for a reply that never comes
    assert "the lender at rank 1 could not answer" in home["refused"]


def test_a_shared_region_is_seen_by_its_reader_and_one_without_room_leaves_the_exchange_on_gloo(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_actors.models import kv_borrow_shm
    from vllm_actors.models.kv_borrow_link import SHM, SharedRegions

    cpu, prefix = torch.device("cpu"), region_prefix(tmp_path)
    qkv = torch.randn(3, 8, 16).to(torch.bfloat16)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    writer, reader = SharedRegions(prefix, 4, cpu), SharedRegions(prefix, 4, cpu)
    packed, where = QkvStaging(writer, 0).packed(q, k, v)
    assert where == SHM and torch.equal(reader.read(f"{prefix}-q0", (3, 8, 16), torch.bfloat16), qkv)  # another map
    assert writer.written(f"{prefix}-q0", (5, 8, 16), torch.bfloat16) is None  # more than its 4 tokens: gloo
    writer.close()
    assert not list(SHM_FOLDER.glob(prefix + "-*"))  # its writer's close removed it

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")  # a container's 64 MB /dev/shm

    monkeypatch.setattr(kv_borrow_shm.os, "posix_fallocate", no_room)
    tight = SharedRegions(prefix, 4, cpu)
    packed, where = QkvStaging(tight, 0).packed(q, k, v)
    assert where == GLOO and torch.equal(packed, qkv)  # the bytes go over gloo instead, no SIGBUS later
    assert not list(SHM_FOLDER.glob(prefix + "-*"))
