"""The rendezvous of one AFD world: the TCP store on rank 0's host and what the ranks agree on
through it before any link exists (the data plane and the frame layout).

Bounded by the store (rank 0 waits for every rank), not by the process groups' own timeout,
which would break the pairs of an FFN rank that is merely idle.
"""

from __future__ import annotations

import json
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .device import device_identity
from .transport import PROCESS_GROUP_TIMEOUT, choose_data_plane, wait_for_listener
from .wire import WireLayout


def open_store(host: str, port: int, rank: int, world_size: int, timeout_seconds: float,
               closed: threading.Event) -> dist.TCPStore:
    """Rank 0 hosts the store; the others wait for its listener (or for ``closed``) first."""
    if rank != 0:
        wait_for_listener(host, port, time.monotonic() + timeout_seconds, closed)
    return dist.TCPStore(host, port, world_size, rank == 0, timedelta(seconds=timeout_seconds))


def agree_on_world(store: dist.TCPStore, rank: int, world_size: int, requested_plane: str, device: torch.device,
                   layout: WireLayout) -> str:
    """The data plane of the world. Every rank publishes its request, device and frame layout
    and applies the same rule to all of them, so both ends of every pair pick the same plane
    and frame sizes; ranks with different layouts are refused (ValueError), each with the
    reason."""
    store.set(f"afd/data-plane/{rank}", json.dumps([requested_plane, device_identity(device), layout.describe()]))
    keys = [f"afd/data-plane/{r}" for r in range(world_size)]
    store.wait(keys, PROCESS_GROUP_TIMEOUT)
    published = [json.loads(store.get(key)) for key in keys]
    layouts = {described for _, _, described in published}
    refusal = None if len(layouts) == 1 else ValueError(
        "AFD frame layout: every rank of the world must use the same model and "
        f"--max-num-batched-tokens (got {' | '.join(sorted(layouts))})")
    _hold_store_until_all_read(store, rank, world_size, refusing=refusal is not None)
    if refusal is not None:
        raise refusal
    return choose_data_plane([(plane, identity) for plane, identity, _ in published])


def _hold_store_until_all_read(store: dist.TCPStore, rank: int, world_size: int, refusing: bool) -> None:
    """Rank 0 hosts the store: it waits until every other rank has read what was published, so
    a refusal reaches each rank as its reason rather than as a closed connection. The others
    only report; once refusing, a report whose reply is lost (rank 0 already left, which it may
    only do after this report arrived) changes nothing."""
    if rank == 0:
        store.wait([f"afd/data-plane-read/{r}" for r in range(1, world_size)], PROCESS_GROUP_TIMEOUT)
        return
    try:
        store.set(f"afd/data-plane-read/{rank}", "1")
    except Exception:
        if not refusing:
            raise
