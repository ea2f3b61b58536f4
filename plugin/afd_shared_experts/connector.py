"""The AFD connector over torch.distributed point to point, ``P2PConnector``: the contract
(``contract.py``) between Attention and FFN ranks, with no model knowledge.

The frames are ``wire.py``'s, the links ``links.py``'s, handles and liveness ``transport.py``'s.

Per (layer, stage) an Attention rank posts the work frames to every FFN rank on the work link
and, at the same moment, the reply receives from every FFN rank on the reply link, all sized by
the dispatch's token count (``wire.py``). On the ``direct`` plane the work goes as two posts,
the headers and then the rows, and nothing in that path reads device data on the host; on
``staged`` the frames go through host memory anyway, and their row counts are read there to
send only the valid rows, in one post. An FFN rank keeps one work receive posted per Attention
rank (on ``direct`` the header's, then the rows' of the size the header gives), reads each
arrived header on its host and answers with the rows only.

Ordering and lifetime rules:
1. A frame is read by its send in stream order (nccl/hccl order a send after the caller's
   current stream; staged copies wait on one event per batch) and is referenced by the
   connector until its send completed: never freed, reused or mutated in flight. Frame sets
   come from a fixed pool (``frames.py``) and are written again only after their sends.
2. A received frame is handed out only once its handle completed (gloo) or once the caller's
   current stream waits for it (nccl/hccl).
3. Each link carries one pair's messages in post order, so the i-th reply receive posted to an
   FFN rank holds that rank's i-th reply, which answers this rank's i-th dispatch (an FFN rank
   answers every Attention rank in that rank's dispatch order). Replies are handed out per
   stage, first in first out.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from .contract import AFDConnector
from .config import DATA_PLANES, DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS, DEFAULT_TIMEOUT_SECONDS, AFDConfig
from .device import host_buffer, resolve_device, to_device, to_host
from .frames import FramePool, FrameSet, new_frame_set, pool_size
from .errors import AFDError, ConnectorClosedError, DeviceUnavailableError, PairingError, PayloadError, PeerLostError
from .metrics import RuntimeMetrics
from .rendezvous import agree_on_world, open_store
from .links import LinkTransportFactory, link_transports
from .transport import (DEVICE_POLL_SECONDS, LINKS, RECV, SEND, WAIT_SLICE_SECONDS, WATCHER_JOIN_SECONDS, Heartbeat,
                        InFlight, Link, P2POperation, StreamOrdered, Transport)
from .wire import (BYTE_KINDS, KIND_SHUTDOWN, ROWS_FIELD, TAG_REPLY, TAG_WORK, TOKENS_FIELD, DispatchTicket,
                   FFNPayload, StepCounter, WireLayout, WorkHeader, WorkItem, check_stage, frame_rows, read_work_header)

CPU = torch.device("cpu")
logger = logging.getLogger(__name__)


@dataclass(eq=False)
class _Dispatch:
    ticket: DispatchTicket
    frames: FrameSet
    receives: list
    reply_rows: list[int] | None  # per FFN rank, known on the host under ``staged``


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
        layout: WireLayout,
        device: str | torch.device = "cpu",
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        rendezvous_timeout_seconds: float = DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS,
        data_plane: str = "auto",
        metrics: RuntimeMetrics | None = None,
        transport_wrapper: Callable[[Transport], Transport] | None = None,
        link_transport: LinkTransportFactory | None = None,
        frame_sets: int = pool_size(1),
    ):
        if role not in ("attention", "ffn"):
            raise ValueError(f"role must be attention or ffn (got {role!r})")
        world = num_attention_ranks + num_ffn_ranks
        in_range = 0 <= rank < num_attention_ranks if role == "attention" else num_attention_ranks <= rank < world
        if not in_range:
            raise ValueError(f"rank {rank} is not a {role} rank of a {num_attention_ranks}A{num_ffn_ranks}F world")
        if data_plane not in DATA_PLANES:
            raise ValueError(f"data_plane must be one of {', '.join(DATA_PLANES)} (got {data_plane!r})")
        if layout.num_ffn_ranks != num_ffn_ranks:
            raise ValueError(f"layout is for {layout.num_ffn_ranks} FFN ranks, the world has {num_ffn_ranks}")
        self.role, self.rank = role, rank
        self.num_attention_ranks, self.num_ffn_ranks = num_attention_ranks, num_ffn_ranks
        self.world_size = world
        self.host, self.port = host, port
        self.layout = layout
        self.hidden_size, self.dtype = layout.hidden_size, layout.dtype
        self.device = resolve_device(device)
        self.timeout_seconds = timeout_seconds
        self.rendezvous_timeout_seconds = rendezvous_timeout_seconds
        self.requested_data_plane = data_plane
        self.data_plane: str | None = None  # agreed by the world at init()
        self.metrics = metrics
        self._transport_wrapper = transport_wrapper
        self._link_transport = link_transport
        self.sent_bytes = dict.fromkeys(BYTE_KINDS, 0)
        self._store = None
        self._groups: list = []  # the links' transports (a device link's is aborted on a lost peer)
        self._links: dict[str, Link] = {}
        self._closed = threading.Event()
        self._initialized = False
        self._failed = False
        self._lost: PeerLostError | None = None  # set by the heartbeat thread (direct plane)
        self._heartbeat: Heartbeat | None = None
        self._seq = 0
        self._steps = StepCounter()
        self.frame_sets = frame_sets
        self._pool: FramePool | None = None  # Attention side, made at init()
        self._pending: dict[int, deque[_Dispatch]] = {}
        # FFN side: per Attention rank, its posted work receive (with the header already read when
        # it is the direct plane's rows receive) and the frames its items hold.
        self._work_recvs: dict[int, tuple[object, torch.Tensor, WorkHeader | None]] = {}
        self._held: dict[int, deque[tuple[torch.Tensor, int, int, int]]] = {}  # frame, layer, stage, reply rows
        self._free_work: dict[int, list[torch.Tensor]] = {}
        self._source_steps: dict[int, StepCounter] = {}
        self._reply_flights: deque[InFlight] = deque()
        self._reply_frames: list[torch.Tensor] = []  # direct plane: reply frames free for reuse
        self._active_sources: list[int] = []
        self._next_source = 0
        self._wakeup = threading.Event()

    @classmethod
    def from_config(cls, cfg: AFDConfig, *, role: str, rank: int, layout: WireLayout, device: str | torch.device = "cpu",
                    metrics: RuntimeMetrics | None = None,
                    transport_wrapper: Callable[[Transport], Transport] | None = None,
                    data_plane: str | None = None, link_transport: LinkTransportFactory | None = None) -> P2PConnector:
        """The connector of world rank ``rank`` for an ``afd`` config; the data plane comes
        from ``data_plane`` or else the config's ``connector_extra_config.data_plane``."""
        return cls(role=role, rank=rank, num_attention_ranks=cfg.num_attention_ranks,
                   num_ffn_ranks=cfg.num_ffn_ranks, host=cfg.host, port=cfg.port, layout=layout, device=device,
                   timeout_seconds=cfg.timeout_seconds, rendezvous_timeout_seconds=cfg.rendezvous_timeout_seconds,
                   data_plane=data_plane or cfg.data_plane, metrics=metrics, transport_wrapper=transport_wrapper,
                   link_transport=link_transport, frame_sets=pool_size(cfg.num_stages))

    # ------------------------------------------------------------------ lifetime
    @property
    def is_initialized(self) -> bool:
        return self._initialized and not self._closed.is_set()

    @property
    def _staged(self) -> bool:
        return self.data_plane == "staged"

    @property
    def _host_staging(self) -> bool:
        """Staged on an accelerator: frames cross host memory through explicit copies."""
        return self._staged and self.device.type != "cpu"

    def init(self) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: init() after close()")
        try:
            # Liveness afterwards is checked by heartbeats (rendezvous.py: why not the groups' timeout).
            self._store = open_store(self.host, self.port, self.rank, self.world_size,
                                     self.rendezvous_timeout_seconds, self._closed)
            self.data_plane = agree_on_world(self._store, self.rank, self.world_size, self.requested_data_plane,
                                             self.device, self.layout)
            gloo = self._staged or (self.device.type == "cpu" and self._link_transport is None)
            self._groups = link_transports(self._store, self.rank, self.world_size, self.num_attention_ranks,
                                           self.device, gloo=gloo, factory=self._link_transport)
        except (ValueError, DeviceUnavailableError):
            self._failed = True
            raise
        except Exception as exc:
            self._failed = True
            raise PeerLostError(
                f"rank {self.rank} ({self.role}): AFD rendezvous at {self.host}:{self.port} for world size "
                f"{self.world_size} failed within {self.rendezvous_timeout_seconds}s: {exc}"
            ) from exc
        wrap = self._transport_wrapper or (lambda transport: transport)
        self._links = {name: Link(name, wrap(transport), rank=self.rank, wakeup=self._wakeup)
                       for name, transport in zip(LINKS, self._groups)}
        self._heartbeat = Heartbeat(self.host, self.port, self.rank, self.timeout_seconds)
        if self.role == "ffn":
            self._active_sources = list(range(self.num_attention_ranks))
            for source in self._active_sources:
                self._held[source], self._free_work[source] = deque(), []
                self._source_steps[source] = StepCounter()
                self._post_work_recv(source)
        else:
            self._pool = FramePool(self.rank, self.frame_sets, lambda: new_frame_set(
                self.layout, self.num_ffn_ranks, self.device, host_staging=self._host_staging))
            if self._links["reply"].on_stream:
                # Its waits are on the device stream: the heartbeat thread watches the FFN ranks.
                self._heartbeat.monitor(list(range(self.num_attention_ranks, self.world_size)), self._peer_name,
                                        self._on_peer_lost)
        self._initialized = True

    def _on_peer_lost(self, error: PeerLostError) -> None:
        self._lost, self._failed = error, True
        for group in self._groups:
            abort = getattr(group, "abort", None)
            if abort is not None:
                abort()  # fails the device receives the stream is waiting on

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
        self._pending, self._pool, self._reply_flights, self._reply_frames = {}, None, deque(), []
        self._work_recvs, self._held, self._free_work = {}, {}, {}
        self._links, self._groups = {}, []
        self._store = None

    def _send_shutdown(self) -> None:
        layout = self.layout
        frames = layout.work_frames(self.num_ffn_ranks, CPU)
        headers = layout.headers(frames).zero_()
        headers[:, :TOKENS_FIELD] = torch.tensor(layout.static_header(KIND_SHUTDOWN, -1, 0, 1, self.rank),
                                                 dtype=torch.int32)
        # The header alone: the FFN side's posted receive is a header's (direct) or accepts it (staged).
        ops = [P2POperation(SEND, self._on_link_device(frames[f, :layout.header_rows]), self.num_attention_ranks + f,
                            TAG_WORK)
               for f in range(self.num_ffn_ranks)]
        try:
            handles = self._post("work", ops)
            self._wait(handles, "shutdown notice", peers=[], deadline=time.monotonic() + min(5.0, self.timeout_seconds))
        except AFDError:
            pass  # peers already gone (a send may fail at once): nothing left to notify

    def _on_link_device(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if self._staged else tensor.to(self.device)

    def _require_open(self, side: str) -> None:
        if self._closed.is_set():
            raise ConnectorClosedError(f"rank {self.rank}: connector is closed")
        if not self._initialized:
            raise AFDError(f"rank {self.rank}: connector used before init()")
        if self.role != side:
            raise AFDError(f"rank {self.rank}: {side}-side operation on a {self.role} connector")
        if self._lost is not None:
            raise self._lost

    # ------------------------------------------------------------------ posting and waiting
    def _post(self, link: str, ops: list[P2POperation], *, answered: bool = False) -> list:
        try:
            return self._links[link].post(ops, answered=answered)
        except Exception as exc:  # e.g. the pair was closed by a dead peer
            self._failed = True
            names = ", ".join(sorted({self._peer_name(op.peer) for op in ops}))
            raise PeerLostError(f"rank {self.rank}: connection to {names} failed: {exc}") from exc

    def _wait(self, handles: list, what: str, *, peers: list[int], deadline: float | None) -> None:
        """Wait on the host until every handle completes; close() unblocks us and a lost peer
        surfaces as an error within the timeout."""
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

    def _peer_name(self, rank: int) -> str:
        first_ffn = self.num_attention_ranks
        return f"Attention rank {rank}" if rank < first_ffn else f"FFN rank {rank - first_ffn} (world rank {rank})"

    def _count(self, kind: str, nbytes: int) -> None:
        self.sent_bytes[kind] += nbytes
        if self.metrics is not None:
            self.metrics.sent_bytes.labels(kind=kind).inc(nbytes)

    # ------------------------------------------------------------------ Attention side
    def _after_sends(self, frames: FrameSet) -> None:
        for handle in frames.sends.handles:
            if isinstance(handle, StreamOrdered):
                self._finish(handle, "work frame send", [handle.peer])  # the stream waits, the host does not
            elif not handle.is_completed():  # gloo sends are answered by their replies, before release
                raise PairingError(f"rank {self.rank}: a released frame set's send to {self._peer_name(handle.peer)} "
                                   "is unanswered")

    def acquire(self) -> FrameSet:
        self._require_open("attention")
        return self._pool.take(self._after_sends)

    def release(self, frames: FrameSet) -> None:
        self._pool.give_back(frames)

    def dispatch(self, layer: int, stage: int, frames: FrameSet, *, tokens: int, stages: int = 1) -> DispatchTicket:
        self._require_open("attention")
        check_stage(stage, stages, what=f"rank {self.rank}: dispatch of layer {layer}")
        layout, first_ffn = self.layout, self.num_attention_ranks
        layout.check_tokens(tokens, f"rank {self.rank}: dispatch of layer {layer}")
        ticket = DispatchTicket(layer=layer, seq=self._seq, stage=stage, step=self._steps.advance(layer, stage))
        self._seq += 1
        queue_ = self._pending.setdefault(stage, deque())
        while queue_ and queue_[0].ticket.step < ticket.step:  # its step failed before combining it
            logger.warning("afd rank %d: %s was never combined; its replies are drained", self.rank, queue_[0].ticket)
            self.release(self._replies(queue_.popleft())[1])
        ffn_ranks = range(self.num_ffn_ranks)
        if self._staged:
            # The frames go through host memory: their row counts are read there, once per dispatch.
            headers = layout.headers(frames.work)
            if frames.work_host is not None:
                headers = headers.cpu()
            header_values = headers.tolist()
            sends = [frames.work[f, :layout.header_rows + h[ROWS_FIELD]] for f, h in enumerate(header_values)]
            if frames.work_host is not None:
                sends = to_host(sends, [frames.work_host[f, :len(send)] for f, send in enumerate(sends)])
            reply_rows = [h[ROWS_FIELD] + sum(h[-layout.local_experts:]) for h in header_values]  # + shared rows
            reply = frames.reply if frames.reply_host is None else frames.reply_host
            posts = [sends]
        else:  # the headers, then the rows sized for the rung of ``tokens``, as the FFN side posts them
            header_rows, rows = layout.header_rows, layout.rows_message_rows(tokens)
            posts = [[frames.work[f, :header_rows] for f in ffn_ranks],
                     [frames.work[f, header_rows:header_rows + rows] for f in ffn_ranks]]
            reply_rows, reply = None, frames.reply[:, :layout.reply_message_rows(tokens)]
        for sends in posts:
            send_handles = self._post("work", [P2POperation(SEND, sends[f], first_ffn + f, TAG_WORK)
                                               for f in ffn_ranks],
                                      answered=True)  # an FFN rank replies once it has received all of its frame
            for handle, tensor in zip(send_handles, sends):
                frames.sends.add(handle, tensor)
                self._count("work", tensor.numel() * tensor.element_size())
        receives = self._post("reply", [P2POperation(RECV, reply[f], first_ffn + f, TAG_REPLY) for f in ffn_ranks])
        queue_.append(_Dispatch(ticket, frames, receives, reply_rows))
        return ticket

    def receive_replies(self, stage: int) -> tuple[DispatchTicket, FrameSet]:
        self._require_open("attention")
        queue_ = self._pending.get(stage)
        if not queue_:
            raise PairingError(f"rank {self.rank}: receive_replies(stage={stage}) without a pending dispatch")
        return self._replies(queue_.popleft())

    def _replies(self, pending: _Dispatch) -> tuple[DispatchTicket, FrameSet]:
        stage, started = pending.ticket.stage, time.monotonic()
        peers = [self.num_attention_ranks + f for f in range(self.num_ffn_ranks)]
        what = f"reply to layer {pending.ticket.layer} stage {stage}"
        if isinstance(pending.receives[0], StreamOrdered):
            for handle, peer in zip(pending.receives, peers):
                self._finish(handle, what, [peer])  # the stream waits; the host runs on
        else:
            self._wait(pending.receives, what, peers=peers, deadline=started + self.timeout_seconds)
        frames = pending.frames
        frames.sends.answer()
        if frames.reply_host is not None:
            for f, rows in enumerate(pending.reply_rows):
                to_device(frames.reply_host[f, :rows], self.device, out=frames.reply[f, :rows], reuse_host=True)
        if self.metrics is not None:
            self.metrics.attention_reply_wait.observe(time.monotonic() - started)
        return pending.ticket, frames

    def pending_dispatches(self) -> int:
        return sum(len(q) for q in self._pending.values())

    # ------------------------------------------------------------------ FFN side
    def _post_work_recv(self, source: int) -> None:
        """The next work receive from ``source``: the whole frame (staged) or its header (direct)."""
        free = self._free_work[source]
        if free:
            frame = free.pop()
        else:
            device = CPU if self._staged else self.device
            frame = host_buffer((self.layout.work_rows, self.hidden_size), self.dtype, self.device) \
                if self._host_staging else self.layout.work_frames(1, device)[0]
        message = frame if self._staged else frame[:self.layout.header_rows]
        (handle,) = self._post("work", [P2POperation(RECV, message, source, TAG_WORK)])
        self._work_recvs[source] = (handle, frame, None)

    def _post_rows_recv(self, source: int, frame: torch.Tensor, header: WorkHeader) -> None:
        """The direct plane's rows receive, of the size both ends derive from the header's tokens."""
        start = self.layout.header_rows
        rows = frame[start:start + self.layout.rows_message_rows(header.tokens)]
        (handle,) = self._post("work", [P2POperation(RECV, rows, source, TAG_WORK)])
        self._work_recvs[source] = (handle, frame, header)

    def active_sources(self) -> list[int]:
        return list(self._active_sources)

    def receive_work(self, timeout: float | None = None) -> WorkItem | None:
        self._require_open("ffn")
        self._reap_replies()
        started = time.monotonic()
        while True:
            if not self._active_sources:
                return None
            self._wakeup.clear()
            # Serve whichever Attention rank's frame arrived, rotating the start for fairness.
            count = len(self._active_sources)
            for offset in range(count):
                source = self._active_sources[(self._next_source + offset) % count]
                handle, frame, header = self._work_recvs[source]
                if not handle.is_completed():
                    continue
                self._finish(handle, "work frame", [source])
                if header is None:  # the FFN side reads headers on its host
                    header = read_work_header(frame, self.layout, source=source)
                    if not self._staged and header.kind != KIND_SHUTDOWN:
                        self._post_rows_recv(source, frame, header)  # arrives after the header
                        continue
                self._next_source = (self._next_source + offset + 1) % count
                item = self._take_work(source, frame, header)
                if item is not None and self.metrics is not None:
                    self.metrics.ffn_work_wait.observe(time.monotonic() - started)
                return item  # None: the source shut down
            self._check_progress("work", self._active_sources, None)
            waited = time.monotonic() - started
            if timeout is not None and waited >= timeout:
                return None
            slice_ = WAIT_SLICE_SECONDS if timeout is None else min(WAIT_SLICE_SECONDS, timeout - waited)
            if self._links["work"].on_stream:
                time.sleep(min(slice_, DEVICE_POLL_SECONDS))  # device works signal no host event: poll
            else:
                self._wakeup.wait(slice_)

    def _take_work(self, source: int, frame: torch.Tensor, work: WorkHeader) -> WorkItem | None:
        rows = frame_rows(frame, self.layout, work)
        if work.kind == KIND_SHUTDOWN:
            self._active_sources.remove(source)
            del self._work_recvs[source]
            return None
        if self._host_staging:
            rows = to_device(rows, self.device, reuse_host=True)
        self._held[source].append((frame, work.layer, work.stage, self.layout.reply_message_rows(work.tokens)))
        # The next receive is posted at once: the sender may already be sending it.
        self._post_work_recv(source)
        return WorkItem(source=source, layer=work.layer, stage=work.stage, stages=work.stages,
                        step=self._source_steps[source].advance(work.layer, work.stage),
                        payload=FFNPayload(rows=rows, routed_counts=work.routed_counts,
                                           shared_prefix=work.shared_prefix, shared_extra=work.shared_extra))

    def send_reply(self, item: WorkItem, rows: torch.Tensor) -> None:
        self._require_open("ffn")
        expected = item.payload.routed_rows + item.payload.shared_rows
        if rows.shape != (expected, self.hidden_size):
            raise PayloadError(f"reply rows shape {tuple(rows.shape)} must be ({expected}, {self.hidden_size})")
        held = self._held.get(item.source)
        if not held or held[0][1:3] != (item.layer, item.stage):
            oldest = f"layer {held[0][1]} stage {held[0][2]}" if held else "none"
            raise PairingError(f"rank {self.rank}: reply to Attention rank {item.source} for layer {item.layer} stage "
                               f"{item.stage}, but its oldest unanswered work item is {oldest} (replies go out in "
                               "each Attention rank's dispatch order)")
        frame, _, _, reply_rows = held.popleft()
        self._free_work[item.source].append(frame)  # its rows were read to compute ``rows``
        if self._staged:
            (buffer,) = to_host([rows])
            message = buffer
        else:  # nccl/hccl receive exactly what is sent: the reply of the dispatch's rung, posted by its size
            buffer = self._reply_frames.pop() if self._reply_frames else self.layout.reply_frames(1, self.device)[0]
            message = buffer[:reply_rows]
            message[:expected] = rows
        (handle,) = self._post("reply", [P2POperation(SEND, message, item.source, TAG_REPLY)])
        flight = InFlight()
        flight.add(handle, buffer)  # the whole buffer, reused for any later reply
        self._reply_flights.append(flight)
        self._count("replies", message.numel() * message.element_size())
        self._reap_replies()

    def _reap_replies(self) -> None:
        while self._reply_flights and self._reply_flights[0].done():
            flight = self._reply_flights.popleft()
            for handle in flight.handles:
                self._finish(handle, "reply send", [handle.peer])
            if not self._staged:
                self._reply_frames.extend(flight.tensors)

    def sends_in_flight(self) -> int:
        return len(self._reply_flights) + (self._pool.sends_in_flight() if self._pool is not None else 0)
