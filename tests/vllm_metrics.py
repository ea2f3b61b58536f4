"""A vLLM /metrics endpoint stand-in for the drain probe's tests: the one gauge the probe reads,
served over real HTTP on the address a pod would have."""

from __future__ import annotations

import http.server
import threading
from typing import Any


class FakeVllmMetrics:
    """A /metrics endpoint on a pod's (loopback) IP and API port, as vLLM serves it."""

    def __init__(self, ip: str, port: int):
        self.running = 1
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = (f'# TYPE vllm:num_requests_running gauge\n'
                        f'vllm:num_requests_running{{model_name="tiny"}} {outer.running}.0\n').encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer((ip, port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
