"""FFN side: serve work items from any Attention rank, always reply."""

from __future__ import annotations

import threading
from collections import Counter
from typing import Protocol

import torch

from .compute import shared_expert_output, swiglu
from .connector import AFDConnector, WorkItem
from .errors import AFDError, ConnectorClosedError, PayloadError
from .metrics import RuntimeMetrics
from .model import FFNMoEWeights


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


class FFNRuntime:
    def __init__(self, connector: AFDConnector, experts: dict[int, LayerExperts], metrics: RuntimeMetrics | None = None):
        self.connector, self.experts, self.metrics = connector, experts, metrics
        self.shared_tokens = 0
        self.zero_token_replies = Counter()  # kind -> count
        self.items_served = 0
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
        layer = self.experts.get(item.layer)
        if layer is None:
            raise PayloadError(f"work item from Attention rank {item.source}: layer {item.layer} is not a MoE layer "
                               f"held here (held: {sorted(self.experts)})")
        payload = item.payload
        x = payload.rows
        routed_rows, shared_rows = payload.routed_rows, payload.shared_rows
        out = x.new_empty(routed_rows + shared_rows, x.shape[1])
        if routed_rows:
            out[:routed_rows] = layer.routed(x[:routed_rows], list(payload.routed_counts))
        # Shared rows: each expert group's first `prefix` rows, then the extra rows at the end.
        shared_inputs, offset = [], 0
        for count, prefix in zip(payload.routed_counts, payload.shared_prefix):
            if prefix:
                shared_inputs.append(x[offset:offset + prefix])
            offset += count
        if payload.shared_extra:
            shared_inputs.append(x[routed_rows:])
        if shared_rows:
            if not layer.holds_shared:
                raise PayloadError(f"work item from Attention rank {item.source}: {shared_rows} shared rows but this "
                                   "FFN rank holds no shared expert (placement is 'attention')")
            out[routed_rows:] = layer.shared(torch.cat(shared_inputs))
        self._record(item, routed_rows, shared_rows)
        return out, routed_rows, shared_rows

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
        """Run until every Attention rank has shut down or ``stop()`` closes the connector."""
        try:
            while True:
                item = self.connector.receive_work()
                if item is None:
                    return
                with self._item_lock:
                    rows, routed_rows, shared_rows = self.process(item)
                    self.connector.send_reply(item, rows, routed_rows, shared_rows)
        except ConnectorClosedError:
            if not self._stopping.is_set():
                raise
        except BaseException as exc:
            if self.metrics is not None:
                self.metrics.errors.labels(kind=type(exc).__name__).inc()
            raise

    def start(self) -> "FFNRuntime":
        def run():
            try:
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
