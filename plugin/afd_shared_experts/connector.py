"""The AFD connector: the transport contract between Attention and FFN ranks (no model
knowledge) and its torch.distributed point-to-point implementation, ``P2PConnector``.

The messages are ``wire.py``'s, the links, handles and liveness ``transport.py``'s.

Ordering and lifetime rules:
1. Payloads are read by the send in stream order (nccl/hccl order a send after the caller's
   current stream; staged copies wait on one event per batch); a sent tensor is referenced by
   the connector until its handle reports completion: never freed, reused or mutated in flight.
2. A received tensor is handed out only once its handle completed (gloo) or once the caller's
   current stream waits for it (nccl/hccl).
3. Replies are paired with dispatches per stage, first in first out; the header's layer,
   sequence number, stage and row counts must match, otherwise ``PairingError``.
"""

from __future__ import annotations

import json
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from .config import DATA_PLANES, DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS, AFDConfig
from .device import device_identity, host_buffer, new_process_group, orders_on_stream, resolve_device, to_device, to_host
from .errors import AFDError, ConnectorClosedError, PairingError, PayloadError, PeerLostError
from .metrics import RuntimeMetrics
from .transport import (PROCESS_GROUP_TIMEOUT, WAIT_SLICE_SECONDS, WATCHER_JOIN_SECONDS, Heartbeat, InFlight, Link,
                        ProcessGroupTransport, Tracked, Transport, choose_data_plane, wait_for_listener)
from .wire import (BYTE_KINDS, KIND_REPLY, KIND_SHUTDOWN, KIND_WORK, MAGIC, REPLY_HEADER_LEN, TAG_HEADER, TAG_PAYLOAD,
                   DispatchTicket, FFNPayload, WorkItem, check_stage, decode_work_header, encode_work_header,
                   work_header_len)

CPU = torch.device("cpu")


@dataclass
class _ExpectedReply:
    """A reply header receive posted at dispatch, with what the header must say."""

    ticket: DispatchTicket
    routed_rows: int
    shared_rows: int
    handle: Tracked
    header: torch.Tensor



# --------------------------------------------------------------------------- contract


class AFDConnector(ABC):
    """Transport contract between Attention and FFN ranks (no model knowledge)."""

    @abstractmethod
    def init(self) -> None: ...

    @abstractmethod
    def close(self) -> None:
        """Idempotent; safe after partial init; drops pending work and unblocks receivers."""

    @property
    @abstractmethod
    def is_initialized(self) -> bool: ...

    # Attention side
    @abstractmethod
    def dispatch(self, layer: int, stage: int, payloads: list[FFNPayload], *, step: int | None = None,
                 stages: int = 1) -> DispatchTicket:
        """Send one (step, layer, stage) to every FFN rank; ``stages`` is how many stages this
        rank runs in ``step`` (the FFN expects its stages 0..stages-1 of each layer in order).
        ``step`` None: the connector counts forwards itself (a stage-0 dispatch of a layer not
        above the previous one's starts the next step: MoE layers run in increasing order)."""

    @abstractmethod
    def receive_replies(self, stage: int) -> tuple[DispatchTicket, list[torch.Tensor]]:
        """Replies (one per FFN rank) to the oldest pending dispatch of ``stage``."""

    # FFN side
    @abstractmethod
    def receive_work(self, timeout: float | None = None) -> WorkItem | None:
        """Next work item from any Attention rank in arrival order; None when an Attention rank
        shut down, when ``timeout`` seconds passed without work, or once no Attention rank is
        active (``active_sources()`` tells them apart)."""

    @abstractmethod
    def active_sources(self) -> list[int]:
        """Attention ranks that have not shut down."""

    @abstractmethod
    def send_reply(self, item: WorkItem, rows: torch.Tensor, routed_rows: int, shared_rows: int) -> None: ...


# --------------------------------------------------------------------------- p2p implementation


class P2PConnector(AFDConnector):
    def __init__(
        self,
        *,
        role: str,
        rank: int,
        num_attention_ranks: int,
        num_ffn_ranks: int,
        host: str,
        port: int,
        hidden_size: int,
        local_experts: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        rendezvous_timeout_seconds: float = DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS,
        data_plane: str = "auto",
        metrics: RuntimeMetrics | None = None,
        transport_wrapper: Callable[[Transport], Transport] | None = None,
    ):
        if role not in ("attention", "ffn"):
            raise ValueError(f"role must be attention or ffn (got {role!r})")
        world = num_attention_ranks + num_ffn_ranks
        in_range = 0 <= rank < num_attention_ranks if role == "attention" else num_attention_ranks <= rank < world
        if not in_range:
            raise ValueError(f"rank {rank} is not a {role} rank of a {num_attention_ranks}A{num_ffn_ranks}F world")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)} (got {data_plane!r})")
        self.role, self.rank = role, rank
        self.num_attention_ranks, self.num_ffn_ranks = num_attention_ranks, num_ffn_ranks
        self.world_size = world
        self.host, self.port = host, port
        self.hidden_size, self.local_experts, self.dtype = hidden_size, local_experts, dtype
        self.device = resolve_device(device)
        self.timeout_seconds = timeout_seconds
        self.rendezvous_timeout_seconds = rendezvous_timeout_seconds
        self.requested_data_plane = data_plane
        self.data_plane: str | None = None  # agreed by the world at init()
        self.metrics = metrics
        self._transport_wrapper = transport_wrapper
        self.sent_bytes = dict.fromkeys(BYTE_KINDS, 0)
        self._store = None
        self._links: dict[str, Link] = {}
        self._closed = threading.Event()
        self._initialized = False
        self._failed = False
        self._heartbeat: Heartbeat | None = None
        self._seq = 0
        self._counted_steps, self._last_layer = 0, None  # forwards counted when callers name no step
        self._pending: dict[int, deque[DispatchTicket]] = {}
        self._expected: dict[int, deque[_ExpectedReply]] = {}
        self._arrived: dict[int, dict[int, tuple[torch.Tensor, object]]] = {}
        self._sends_in_flight: deque[InFlight] = deque()
        self._header_recvs: dict[int, tuple[Tracked, torch.Tensor]] = {}
        self._active_sources: list[int] = []
        self._next_source = 0
        self._wakeup = threading.Event()

    @classmethod
    def from_config(cls, cfg: AFDConfig, *, role: str, rank: int, hidden_size: int, local_experts: int,
                    dtype: torch.dtype, device: str | torch.device = "cpu", metrics: RuntimeMetrics | None = None,
                    transport_wrapper: Callable[[Transport], Transport] | None = None,
                    data_plane: str | None = None) -> P2PConnector:
        """The connector of world rank ``rank`` for an ``afd`` config; the data plane comes
        from ``data_plane`` or else the config's ``connector_extra_config.data_plane``."""
        return cls(role=role, rank=rank, num_attention_ranks=cfg.num_attention_ranks,
                   num_ffn_ranks=cfg.num_ffn_ranks, host=cfg.host, port=cfg.port, hidden_size=hidden_size,
                   local_experts=local_experts, dtype=dtype, device=device, timeout_seconds=cfg.timeout_seconds,
                   rendezvous_timeout_seconds=cfg.rendezvous_timeout_seconds, data_plane=data_plane or cfg.data_plane, metrics=metrics,
                   transport_wrapper=transport_wrapper)

    # ------------------------------------------------------------------ lifetime
    @property
    def is_initialized(self) -> bool:
        return self._initialized and not self._closed.is_set()

    @property
    def _staged(self) -> bool:
        return self.data_plane == "staged"

    def init(self) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: init() after close()")
        timeout = timedelta(seconds=self.rendezvous_timeout_seconds)
        try:
            # The store bounds the rendezvous; the process groups' own timeout would break the
            # pairs of an FFN rank that is merely idle, so liveness is checked by heartbeats instead.
            if self.rank != 0:
                wait_for_listener(self.host, self.port, time.monotonic() + self.rendezvous_timeout_seconds,
                                  self._closed)
            self._store = dist.TCPStore(self.host, self.port, self.world_size, self.rank == 0, timeout)
            self.data_plane = self._agree_on_data_plane()
            data_device = CPU if self._staged else self.device
            groups = {"work-control": CPU, "reply-control": CPU, "work-data": data_device, "reply-data": data_device}
            transports = {
                name: ProcessGroupTransport(new_process_group(
                    device, dist.PrefixStore(f"afd/{name}", self._store), self.rank, self.world_size,
                    PROCESS_GROUP_TIMEOUT))
                for name, device in groups.items()
            }
        except ValueError:
            self._failed = True
            raise
        except Exception as exc:
            self._failed = True
            raise PeerLostError(
                f"rank {self.rank} ({self.role}): AFD rendezvous at {self.host}:{self.port} for world size "
                f"{self.world_size} failed within {self.rendezvous_timeout_seconds}s: {exc}"
            ) from exc
        wrap = self._transport_wrapper or (lambda transport: transport)
        self._links = {name: Link(name, wrap(transport), on_stream=orders_on_stream(groups[name]), rank=self.rank,
                                   wakeup=self._wakeup)
                       for name, transport in transports.items()}
        self._heartbeat = Heartbeat(self.host, self.port, self.rank, self.timeout_seconds)
        if self.role == "ffn":
            self._active_sources = list(range(self.num_attention_ranks))
            for source in self._active_sources:
                self._post_header_recv(source)
        else:
            self._expected = {f: deque() for f in range(self.num_ffn_ranks)}
            self._arrived = {f: {} for f in range(self.num_ffn_ranks)}
        self._initialized = True

    def _agree_on_data_plane(self) -> str:
        """Every rank publishes its request and device in the store and applies the same rule
        to all of them, so both ends of every pair pick the same plane. Bounded like the
        process groups' rendezvous: by the store (rank 0 waits for every rank to connect)."""
        self._store.set(f"afd/data-plane/{self.rank}",
                        json.dumps([self.requested_data_plane, device_identity(self.device)]))
        keys = [f"afd/data-plane/{r}" for r in range(self.world_size)]
        self._store.wait(keys, PROCESS_GROUP_TIMEOUT)
        return choose_data_plane([tuple(json.loads(self._store.get(key))) for key in keys])

    def close(self) -> None:
        if self._closed.is_set():
            return
        if self._initialized and not self._failed and self.role == "attention":
            self._send_shutdown()
        self._closed.set()
        self._wakeup.set()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        # Joined so no watcher is still inside the backend when the process exits.
        deadline = time.monotonic() + WATCHER_JOIN_SECONDS
        for link in self._links.values():
            link.stop(deadline)
        # Drop pending work and retained tensors (the process groups go with them). Fresh
        # containers, not clear(): a receiver blocked in another thread still iterates the old ones.
        self._pending, self._expected, self._arrived = {}, {}, {}
        self._sends_in_flight = deque()
        self._header_recvs = {}
        self._links = {}
        self._store = None

    def _send_shutdown(self) -> None:
        handles = []
        try:
            for f in range(self.num_ffn_ranks):
                header = encode_work_header(KIND_SHUTDOWN, -1, self._seq, -1, self.rank, self.dtype, self.hidden_size,
                                            None, self.local_experts)
                handles.append(self._isend("work-control", header, self.num_attention_ranks + f, TAG_HEADER))
            self._wait(handles, "shutdown notice", peers=[], deadline=time.monotonic() + min(5.0, self.timeout_seconds))
        except AFDError:
            pass  # peers already gone (a send may fail at once): nothing left to notify

    def _require_open(self, side: str) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: connector is closed")
        if not self._initialized:
            raise AFDError(f"rank {self.rank}: connector used before init()")
        if self.role != side:
            raise AFDError(f"rank {self.rank}: {side}-side operation on a {self.role} connector")

    # ------------------------------------------------------------------ posting and waiting
    def _isend(self, link: str, tensor: torch.Tensor, dst: int, tag: int):
        return self._post(self._links[link], "isend", tensor, dst, tag)

    def _irecv(self, link: str, tensor: torch.Tensor, src: int, tag: int):
        return self._post(self._links[link], "irecv", tensor, src, tag)

    def _post(self, link: Link, operation: str, tensor: torch.Tensor, peer: int, tag: int):
        try:
            handle = getattr(link.transport, operation)(tensor, peer, tag)
        except Exception as exc:  # e.g. the pair was closed by a dead peer
            self._failed = True
            raise PeerLostError(f"rank {self.rank}: connection to {self._peer_name(peer)} failed: {exc}") from exc
        return link.track(handle, peer)

    def _wait(self, handles: list, what: str, *, peers: list[int], deadline: float | None) -> None:
        """Wait until every handle completes; close() unblocks us and a lost peer surfaces
        as an error within the timeout."""
        for handle in handles:
            while not handle.ready(WAIT_SLICE_SECONDS):
                self._check_progress(what, peers, deadline)
            if self._closed.is_set():
                raise ConnectorClosedError(f"rank {self.rank}: connector closed while waiting for {what}")
            self._finish(handle, what, peers)

    def _check_progress(self, what: str, peers: list[int], deadline: float | None) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: connector closed while waiting for {what}")
        if peers:
            self._heartbeat.check(peers, self._peer_name)
        if deadline is not None and time.monotonic() > deadline:
            self._failed = True
            names = ", ".join(self._peer_name(p) for p in peers) or "peers"
            raise PeerLostError(f"rank {self.rank}: no {what} from {names} within {self.timeout_seconds}s "
                                "(peer dead or not answering)")

    def _finish(self, handle, what: str, peers: list[int] = ()) -> None:
        try:
            handle.result()
        except Exception as exc:
            self._failed = True
            names = ", ".join(self._peer_name(p) for p in peers) or "a peer"
            raise PeerLostError(f"rank {self.rank}: connection to {names} failed during {what}: {exc}") from exc

    def _outgoing(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Payload tensors as the data plane sends them: host copies when staged."""
        return to_host(tensors) if self._staged else [t.contiguous() for t in tensors]

    def _post_payload_recv(self, link: str, rows: int, peer: int) -> tuple[torch.Tensor, object]:
        """A payload receive, posted only once a header announced it (an idle rank never has
        a device receive pending); no receive at all for zero rows."""
        shape = (rows, self.hidden_size)
        buffer = host_buffer(shape, self.dtype, self.device) if self._staged else \
            torch.empty(shape, dtype=self.dtype, device=self.device)
        return buffer, (self._irecv(link, buffer, peer, TAG_PAYLOAD) if rows else None)

    def _received(self, buffer: torch.Tensor, handle, what: str, peer: int) -> torch.Tensor:
        if handle is not None:
            self._wait([handle], what, peers=[peer], deadline=time.monotonic() + self.timeout_seconds)
        return to_device(buffer, self.device) if self._staged else buffer

    def _reap_sends(self) -> None:
        while self._sends_in_flight and self._sends_in_flight[0].done():
            for handle in self._sends_in_flight[0].handles:
                self._finish(handle, "send", [handle.peer])
            self._sends_in_flight.popleft()

    def sends_in_flight(self) -> int:
        return len(self._sends_in_flight)

    def _peer_name(self, rank: int) -> str:
        if rank < self.num_attention_ranks:
            return f"Attention rank {rank}"
        return f"FFN rank {rank - self.num_attention_ranks} (world rank {rank})"

    def _count(self, kind: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        self.sent_bytes[kind] += nbytes
        if self.metrics is not None:
            self.metrics.sent_bytes.labels(kind=kind).inc(nbytes)

    # ------------------------------------------------------------------ Attention side
    def dispatch(self, layer: int, stage: int, payloads: list[FFNPayload], *, step: int | None = None,
                 stages: int = 1) -> DispatchTicket:
        self._require_open("attention")
        check_stage(stage, stages, what=f"rank {self.rank}: dispatch of layer {layer}")
        if step is not None and step < 0:
            raise PayloadError(f"rank {self.rank}: dispatch of layer {layer}: step must be >= 0 (got {step})")
        if len(payloads) != self.num_ffn_ranks:
            raise ValueError(f"dispatch needs one payload per FFN rank ({self.num_ffn_ranks}), got {len(payloads)}")
        for f, payload in enumerate(payloads):
            if payload.rows.shape != (payload.routed_rows + payload.shared_extra, self.hidden_size):
                raise PayloadError(f"payload for FFN rank {f}: rows shape {tuple(payload.rows.shape)} does not match "
                                   f"its counts ({payload.routed_rows} routed + {payload.shared_extra} extra shared)")
        ticket = DispatchTicket(layer=layer, seq=self._seq, stage=stage,
                                step=self._counted_step(layer, stage) if step is None else step)
        self._seq += 1
        sends = InFlight()
        for f, (payload, rows) in enumerate(zip(payloads, self._outgoing([p.rows for p in payloads]))):
            dst = self.num_attention_ranks + f
            header = encode_work_header(KIND_WORK, layer, ticket.seq, stage, self.rank, self.dtype, self.hidden_size,
                                        payload, self.local_experts, step=ticket.step, stages=stages)
            sends.add(self._isend("work-control", header, dst, TAG_HEADER), header)
            self._count("headers", header)
            if rows.shape[0]:
                sends.add(self._isend("work-data", rows, dst, TAG_PAYLOAD), rows)
                self._count("routed_rows", rows[: payload.routed_rows])
                self._count("shared_rows", rows[payload.routed_rows:])
            # The reply header receive waits on the reply group, which carries no send of ours.
            reply_header = torch.empty(REPLY_HEADER_LEN, dtype=torch.int64)
            self._expected[f].append(_ExpectedReply(
                ticket, payload.routed_rows, payload.shared_rows,
                self._irecv("reply-control", reply_header, dst, TAG_HEADER), reply_header))
        self._sends_in_flight.append(sends)
        self._pending.setdefault(stage, deque()).append(ticket)
        return ticket

    def _counted_step(self, layer: int, stage: int) -> int:
        if stage == 0:
            if self._last_layer is not None and layer <= self._last_layer:
                self._counted_steps += 1
            self._last_layer = layer
        return self._counted_steps

    def receive_replies(self, stage: int) -> tuple[DispatchTicket, list[torch.Tensor]]:
        self._require_open("attention")
        queue_ = self._pending.get(stage)
        if not queue_:
            raise PairingError(f"rank {self.rank}: receive_replies(stage={stage}) without a pending dispatch")
        ticket = queue_[0]
        started = time.monotonic()
        deadline = started + self.timeout_seconds
        replies = [self._reply(f, ticket, deadline) for f in range(self.num_ffn_ranks)]
        queue_.popleft()
        self._reap_sends()  # sent buffers are released only once their sends are complete
        if self.metrics is not None:
            self.metrics.attention_reply_wait.observe(time.monotonic() - started)
        return ticket, replies

    def _reply(self, f: int, ticket: DispatchTicket, deadline: float) -> torch.Tensor:
        """FFN rank f's reply to ``ticket``. An FFN rank answers one Attention rank in dispatch
        order, so earlier replies (other stages) are taken first and kept: their payload
        receives are posted in the order the FFN rank sends them."""
        peer = self.num_attention_ranks + f
        arrived = self._arrived[f]
        while ticket.seq not in arrived:
            expected = self._expected[f].popleft()
            self._wait([expected.handle], f"reply to layer {expected.ticket.layer} seq {expected.ticket.seq}",
                       peers=[peer], deadline=deadline)
            self._check_reply_header(expected, peer)
            arrived[expected.ticket.seq] = self._post_payload_recv(
                "reply-data", expected.routed_rows + expected.shared_rows, peer)
        buffer, handle = arrived.pop(ticket.seq)
        return self._received(buffer, handle, f"reply payload of seq {ticket.seq}", peer)

    def _check_reply_header(self, expected: _ExpectedReply, peer: int) -> None:
        ticket = expected.ticket
        got = expected.header.tolist()
        want = [MAGIC, KIND_REPLY, ticket.layer, ticket.seq, ticket.stage, peer, expected.routed_rows,
                expected.shared_rows]
        if got != want:
            self._failed = True
            raise PairingError(
                f"rank {self.rank}: reply from {self._peer_name(peer)} does not match the oldest pending dispatch "
                f"of stage {ticket.stage}: expected [magic, kind, layer, seq, stage, source, routed, shared] = "
                f"{want}, got {got}"
            )

    def pending_dispatches(self) -> int:
        return sum(len(q) for q in self._pending.values())

    # ------------------------------------------------------------------ FFN side
    def _post_header_recv(self, source: int) -> None:
        header = torch.empty(work_header_len(self.local_experts), dtype=torch.int64)
        self._header_recvs[source] = (self._irecv("work-control", header, source, TAG_HEADER), header)

    def active_sources(self) -> list[int]:
        return list(self._active_sources)

    def receive_work(self, timeout: float | None = None) -> WorkItem | None:
        self._require_open("ffn")
        self._reap_sends()
        started = time.monotonic()
        while True:
            if not self._active_sources:
                return None
            self._wakeup.clear()
            # Serve whichever Attention rank's header arrived, rotating the start for fairness.
            header_recvs = self._header_recvs
            count = len(self._active_sources)
            for offset in range(count):
                source = self._active_sources[(self._next_source + offset) % count]
                handle, header = header_recvs[source]
                if handle.is_completed():
                    self._finish(handle, "work header", [source])
                    self._next_source = (self._next_source + offset + 1) % count
                    item = self._take_work(source, header)
                    if item is not None and self.metrics is not None:
                        self.metrics.ffn_work_wait.observe(time.monotonic() - started)
                    return item  # None: the source shut down
            self._check_progress("work", self._active_sources, None)
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                return None
            self._wakeup.wait(WAIT_SLICE_SECONDS if timeout is None else min(WAIT_SLICE_SECONDS, timeout - waited))

    def _take_work(self, source: int, header: torch.Tensor) -> WorkItem | None:
        work = decode_work_header(header, source=source, dtype=self.dtype, hidden=self.hidden_size,
                                  local_experts=self.local_experts)
        if work.kind == KIND_SHUTDOWN:
            self._active_sources.remove(source)
            del self._header_recvs[source]
            return None
        buffer, handle = self._post_payload_recv("work-data", sum(work.routed_counts) + work.shared_extra, source)
        # The next header receive is posted after the payload receive: the order the peer sends in.
        self._post_header_recv(source)
        rows = self._received(buffer, handle, f"work payload from Attention rank {source}", source)
        return WorkItem(source=source, layer=work.layer, seq=work.seq, stage=work.stage, step=work.step,
                        stages=work.stages,
                        payload=FFNPayload(rows=rows, routed_counts=work.routed_counts,
                                           shared_prefix=work.shared_prefix, shared_extra=work.shared_extra))

    def send_reply(self, item: WorkItem, rows: torch.Tensor, routed_rows: int, shared_rows: int) -> None:
        self._require_open("ffn")
        if rows.shape != (routed_rows + shared_rows, self.hidden_size):
            raise PayloadError(f"reply rows shape {tuple(rows.shape)} must be ({routed_rows + shared_rows}, "
                               f"{self.hidden_size})")
        header = torch.tensor([MAGIC, KIND_REPLY, item.layer, item.seq, item.stage, self.rank, routed_rows,
                               shared_rows], dtype=torch.int64)
        flight = InFlight()
        flight.add(self._isend("reply-control", header, item.source, TAG_HEADER), header)
        self._count("headers", header)
        if rows.shape[0]:
            (rows,) = self._outgoing([rows])
            flight.add(self._isend("reply-data", rows, item.source, TAG_PAYLOAD), rows)
            self._count("replies", rows)
        self._sends_in_flight.append(flight)
        self._reap_sends()
