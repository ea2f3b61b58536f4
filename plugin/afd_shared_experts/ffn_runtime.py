"""FFN side: gather each (step, layer, stage) from every Attention rank, compute it in one
expert pass, always reply."""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Protocol

import torch

from .compute import shared_expert_output, swiglu
from .contract import AFDConnector
from .device import select_device
from .wire import WorkItem
from .errors import AFDError, ConnectorClosedError, PayloadError
from .ffn_batching import StageBatcher
from .metrics import RuntimeMetrics
from .model import FFNMoEWeights
from .trace import StageTrace, clocks, stage_trace

# How long a group waits for an Attention rank that has sent no work yet (ffn_batching.py), at
# most half the connector timeout so the waiting ranks' reply deadline is never reached. Long:
# ranks slow to start would otherwise be split off the first group, and a different grouping
# rounds float32 differently (1 s was exceeded at load 9 on 2 cores).
GATHER_WINDOW_SECONDS = 10.0


class LayerExperts(Protocol):
    """One MoE layer's experts as an FFN rank computes them (torch here, vLLM kernels in
    ``vllm.ffn``). Outputs are unweighted: the Attention side's combine applies the top-k
    weights and the routed scaling factor."""

    @property
    def holds_shared(self) -> bool: ...

    def routed(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """E_i(x) for rows grouped by local expert (counts[i] rows for local expert i)."""

    def shared(self, rows: torch.Tensor) -> torch.Tensor:
        """S(x), with Qwen2-MoE's shared-expert gate factor."""


class TorchLayerExperts:
    """The torch expert path over weights from ``model.load_ffn_weights``."""

    def __init__(self, weights: FFNMoEWeights):
        self.weights = weights

    @property
    def holds_shared(self) -> bool:
        return self.weights.shared is not None

    def routed(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out, offset = torch.empty_like(rows), 0
        routed = self.weights.routed
        for expert, count in enumerate(counts):
            if count:  # skip the empty GEMM
                out[offset:offset + count] = swiglu(rows[offset:offset + count], routed.gate_up[expert],
                                                    routed.down[expert])
            offset += count
        return out

    def shared(self, rows: torch.Tensor) -> torch.Tensor:
        return shared_expert_output(rows, self.weights.shared)


def torch_experts(weights: dict[int, FFNMoEWeights]) -> dict[int, LayerExperts]:
    return {layer: TorchLayerExperts(w) for layer, w in weights.items()}


def _routed_blocks(items: list[WorkItem]) -> list[list[tuple[int, int]]]:
    """Per item, its routed rows' (offset, count) per local expert, in wire order."""
    blocks = []
    for item in items:
        offset, spans = 0, []
        for count in item.payload.routed_counts:
            spans.append((offset, count))
            offset += count
        blocks.append(spans)
    return blocks


def _shared_inputs(item: WorkItem) -> list[torch.Tensor]:
    """An item's shared rows: each expert group's first ``prefix`` rows, then the extra rows."""
    payload, x = item.payload, item.payload.rows
    inputs, offset = [], 0
    for count, prefix in zip(payload.routed_counts, payload.shared_prefix):
        if prefix:
            inputs.append(x[offset:offset + prefix])
        offset += count
    if payload.shared_extra:
        inputs.append(x[payload.routed_rows:])
    return inputs


class FFNRuntime:
    def __init__(self, connector: AFDConnector, experts: dict[int, LayerExperts], metrics: RuntimeMetrics | None = None,
                 *, gather_window: float | None = None):
        self.connector, self.experts, self.metrics = connector, experts, metrics
        self.gather_window = gather_window  # None: resolved by serve(); read per group
        self.shared_tokens = 0
        self.zero_token_replies = Counter()  # kind -> count
        self.items_served = 0
        self.expert_passes = 0  # groups computed, each in one routed and one shared pass
        self.pass_peers = Counter()  # Attention ranks merged by a pass -> passes
        self.partial_groups = 0
        self.trace: StageTrace | None = None  # set by serve() when AFD_TRACE_DIR is set
        self.error: BaseException | None = None
        self._stopping = threading.Event()
        # Held while a received item is processed and answered, so stop() can drain it.
        self._item_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    @property
    def ready(self) -> bool:
        return self.connector.is_initialized and bool(self.experts) and self.error is None

    def process(self, item: WorkItem) -> tuple[torch.Tensor, int, int]:
        """Reply rows for one work item: routed outputs (wire order), then shared outputs."""
        return self.process_group([item])[0]

    def process_group(self, items: list[WorkItem]) -> list[tuple[torch.Tensor, int, int]]:
        """Reply rows per item of one layer, from ONE routed pass over every item's routed rows
        (regrouped by local expert, so each expert's weights run once) and ONE shared pass over
        every item's shared rows; each reply as ``process`` lays it out."""
        first = items[0]
        layer = self.experts.get(first.layer)
        if layer is None:
            raise PayloadError(f"work item from Attention rank {first.source}: layer {first.layer} is not a MoE layer "
                               f"held here (held: {sorted(self.experts)})")
        if any(item.layer != first.layer for item in items):
            raise ValueError(f"one expert pass computes one layer (got layers {sorted({i.layer for i in items})})")
        shared_rows = [item.payload.shared_rows for item in items]
        if sum(shared_rows) and not layer.holds_shared:
            source = next(item.source for item, rows in zip(items, shared_rows) if rows)
            raise PayloadError(f"work item from Attention rank {source}: shared rows but this FFN rank holds no "
                               "shared expert (placement is 'attention')")
        routed_out = self._routed_pass(layer, items)
        shared_out = layer.shared(torch.cat([x for item in items for x in _shared_inputs(item)])) \
            if sum(shared_rows) else None
        replies, shared_offset = [], 0
        for item, routed, shared in zip(items, routed_out, shared_rows):
            x, routed_rows = item.payload.rows, item.payload.routed_rows
            out = x.new_empty(routed_rows + shared, x.shape[1])
            if routed_rows:
                out[:routed_rows] = routed
            if shared:
                out[routed_rows:] = shared_out[shared_offset:shared_offset + shared]
                shared_offset += shared
            replies.append((out, routed_rows, shared))
            self._record(item, routed_rows, shared)
        self._record_pass(first, len(items))
        return replies

    @staticmethod
    def _routed_pass(layer: LayerExperts, items: list[WorkItem]) -> list[torch.Tensor | None]:
        """Each item's routed outputs in its wire order, from one ``layer.routed`` call."""
        if len(items) == 1:  # already grouped by local expert
            payload = items[0].payload
            rows = payload.routed_rows
            return [layer.routed(payload.rows[:rows], list(payload.routed_counts)) if rows else None]
        blocks = _routed_blocks(items)
        experts = len(items[0].payload.routed_counts)
        counts = [sum(item.payload.routed_counts[e] for item in items) for e in range(experts)]
        if not sum(counts):
            return [None] * len(items)
        # Merged order: by local expert, then by item; merged_at[i][e] = where item i's rows of e start.
        pieces, merged_at, offset = [], [[0] * experts for _ in items], 0
        for e in range(experts):
            for i, item in enumerate(items):
                start, count = blocks[i][e]
                merged_at[i][e] = offset
                if count:
                    pieces.append(item.payload.rows[start:start + count])
                offset += count
        merged_out = layer.routed(torch.cat(pieces), counts)
        outputs = []
        for i, item in enumerate(items):
            spans = [merged_out[merged_at[i][e]:merged_at[i][e] + count]
                     for e, (_, count) in enumerate(blocks[i]) if count]
            outputs.append(torch.cat(spans) if spans else None)
        return outputs

    def _record_pass(self, item: WorkItem, peers: int) -> None:
        self.expert_passes += 1
        self.pass_peers[peers] += 1
        if self.metrics is not None:
            self.metrics.ffn_expert_passes.labels(stage=str(item.stage)).inc()
            self.metrics.ffn_pass_peers.observe(peers)

    def _record(self, item: WorkItem, routed_rows: int, shared_rows: int) -> None:
        self.items_served += 1
        self.shared_tokens += shared_rows
        for kind, rows in (("routed", routed_rows), ("shared", shared_rows)):
            if rows == 0:
                self.zero_token_replies[kind] += 1
            if self.metrics is not None:
                self.metrics.tokens_received.labels(kind=kind, layer=str(item.layer)).inc(rows)
                if rows == 0:
                    self.metrics.zero_token_replies.labels(kind=kind).inc()

    def serve(self) -> None:
        """Run until every Attention rank has shut down or ``stop()`` closes the connector:
        gather a group (ffn_batching.py), compute it in one pass, send its replies at once."""
        connector = self.connector
        self.trace = stage_trace("ffn", connector.rank)
        if self.gather_window is None:
            self.gather_window = min(GATHER_WINDOW_SECONDS, connector.timeout_seconds / 2)
        batcher = StageBatcher(connector.active_sources(), name=f"FFN world rank {connector.rank}")
        try:
            waiting = clocks()
            while True:
                group = batcher.pop_group(time.monotonic(), self.gather_window)
                if group is not None:
                    if batcher.partial_groups != self.partial_groups and self.metrics is not None:
                        self.metrics.ffn_partial_groups.inc(batcher.partial_groups - self.partial_groups)
                    self.partial_groups = batcher.partial_groups
                    self._serve_group(group, waiting)
                    waiting = clocks()
                    continue
                active = connector.active_sources()
                for source in set(batcher.sources) - set(active):
                    batcher.close_source(source)
                if not active:
                    return
                item = connector.receive_work(timeout=batcher.seconds_to_deadline(time.monotonic(),
                                                                                  self.gather_window))
                if item is not None:
                    batcher.add(item, time.monotonic())
        except ConnectorClosedError:
            if not self._stopping.is_set():
                raise
        except BaseException as exc:
            if self.metrics is not None:
                self.metrics.errors.labels(kind=type(exc).__name__).inc()
            raise

    def _serve_group(self, group: list[WorkItem], waiting: tuple[int, int]) -> None:
        first, trace = group[0], self.trace
        where = dict(step=first.step, layer=first.layer, stage=first.stage)
        if trace is not None:
            trace.record("group_wait", waiting[0], wall_ns=waiting[1], rows=0, peers=len(group), **where)
        with self._item_lock:
            started = clocks()
            replies = self.process_group(group)
            if trace is not None:
                rows = sum(item.payload.rows.shape[0] for item in group)  # as the dispatches sent them
                trace.record("expert_pass", started[0], wall_ns=started[1], rows=rows, peers=len(group), **where)
                started = clocks()
            for item, (rows, _, _) in zip(group, replies):
                self.connector.send_reply(item, rows)
            if trace is not None:
                trace.record("reply", started[0], wall_ns=started[1], rows=0, peers=len(group), **where)

    def start(self) -> "FFNRuntime":
        device = getattr(self.connector, "device", None)

        def run():
            try:
                # The current device is per thread: this one launches the experts and posts the replies.
                if device is not None:
                    select_device(device)
                self.serve()
            except BaseException as exc:  # stored; surfaced by stop()/join()
                self.error = exc

        self._thread = threading.Thread(target=run, name="afd-ffn-runtime", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        """Wait for the loop to end by itself (shutdown notices); re-raise its stored error."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise AFDError(f"FFN runtime did not finish within {timeout}s")
        if self.error is not None:
            raise self.error

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout: float = 10.0) -> None:
        """Let the work item in flight be answered, close the connector (unblocking the
        loop) and wait a bounded time."""
        self._stopping.set()
        drained = self._item_lock.acquire(timeout=timeout)
        try:
            self.connector.close()
        finally:
            if drained:
                self._item_lock.release()
        if self._thread is not None:
            self.join(timeout)
