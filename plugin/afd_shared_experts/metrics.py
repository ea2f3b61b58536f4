"""Prometheus metrics (per-process registry) and the /metrics, /health, /ready server."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PEER_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
WAIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class RuntimeMetrics:
    """All runtime metrics of one rank; a private registry so several ranks can share a process."""

    def __init__(self, role: str, registry: CollectorRegistry | None = None):
        self.role = role
        self.registry = registry or CollectorRegistry()
        self.tokens_dispatched = Counter(
            "afd_tokens_dispatched_total",
            "Token rows sent by Attention ranks, by kind (routed, shared) and layer",
            ["kind", "layer"],
            registry=self.registry,
        )
        self.tokens_received = Counter(
            "afd_tokens_received_total",
            "Token rows received by FFN ranks, by kind (routed, shared) and layer",
            ["kind", "layer"],
            registry=self.registry,
        )
        self.zero_token_replies = Counter(
            "afd_zero_token_replies_total",
            "FFN replies carrying zero rows of a kind (routed, shared)",
            ["kind"],
            registry=self.registry,
        )
        self.sent_bytes = Counter(
            "afd_connector_sent_bytes_total",
            "Bytes posted on the AFD connector, by kind (routed_rows, shared_rows, headers, replies)",
            ["kind"],
            registry=self.registry,
        )
        self.attention_reply_wait = Histogram(
            "afd_attention_reply_wait_seconds",
            "Time an Attention rank waits for all FFN replies of one dispatch",
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.ffn_work_wait = Histogram(
            "afd_ffn_work_wait_seconds",
            "Time an FFN rank waits for the next work item",
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.ffn_expert_passes = Counter(
            "afd_ffn_expert_passes_total",
            "Expert passes of an FFN rank, by stage: one routed and one shared pass over the rows every "
            "Attention rank sent for one (step, layer, stage)",
            ["stage"],
            registry=self.registry,
        )
        self.ffn_pass_peers = Histogram(
            "afd_ffn_expert_pass_peers",
            "Attention ranks whose rows one FFN expert pass merged",
            buckets=PEER_BUCKETS,
            registry=self.registry,
        )
        self.ffn_partial_groups = Counter(
            "afd_ffn_partial_groups_total",
            "FFN expert passes started without an expected Attention rank's rows (it sent nothing within the "
            "gather window; its rows join a later pass)",
            registry=self.registry,
        )
        self.shared_experts_placement = Gauge(
            "afd_shared_experts_placement_info",
            "Where the shared experts run: the placement requested and the one in effect ('none' for a model "
            "without shared experts)",
            ["requested", "effective"],
            registry=self.registry,
            multiprocess_mode="max",
        )
        self.errors = Counter(
            "afd_errors_total",
            "Runtime errors by kind (exception class)",
            ["kind"],
            registry=self.registry,
        )

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class ProbeServer:
    """Serves /metrics, /health (process alive) and /ready (connector + weights ready).

    metrics_port and health_port may be equal (one listener) or 0 (ephemeral, for tests).
    """

    def __init__(self, metrics: RuntimeMetrics, is_ready: Callable[[], bool], host: str, metrics_port: int, health_port: int):
        self._servers: list[ThreadingHTTPServer] = []
        self._threads: list[threading.Thread] = []
        handler = _make_handler(metrics, is_ready)
        self._servers.append(ThreadingHTTPServer((host, metrics_port), handler))
        if health_port != metrics_port or health_port == 0:
            self._servers.append(ThreadingHTTPServer((host, health_port), handler))
        self.metrics_port = self._servers[0].server_address[1]
        self.health_port = self._servers[-1].server_address[1]

    def start(self) -> "ProbeServer":
        for server in self._servers:
            thread = threading.Thread(target=server.serve_forever, name="afd-probe-server", daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        for server in self._servers:
            server.shutdown()
            server.server_close()
        for thread in self._threads:
            thread.join(timeout=5)


def _make_handler(metrics: RuntimeMetrics, is_ready: Callable[[], bool]):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server naming)
            if self.path == "/metrics":
                self._reply(200, metrics.exposition(), CONTENT_TYPE_LATEST)
            elif self.path == "/health":
                self._reply(200, b"ok\n")
            elif self.path == "/ready":
                ready = is_ready()
                self._reply(200 if ready else 503, b"ready\n" if ready else b"not ready\n")
            else:
                self._reply(404, b"not found\n")

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8"):
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):  # probes every few seconds would flood stderr
            pass

    return Handler
