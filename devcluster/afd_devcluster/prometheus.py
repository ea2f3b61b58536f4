"""Debian's Prometheus for the tests: a server started on a free loopback port with a given
configuration (checked by promtool first), and instant queries against its HTTP API."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.parse
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import yaml

from afd_devcluster.ports import free_port
from afd_devcluster.tools import wait_for

READY_TIMEOUT_SECONDS = 30


def query(base: str, promql: str) -> list[dict[str, Any]]:
    """The result vector of an instant query (the query must be accepted)."""
    url = f"{base}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
    with urllib.request.urlopen(url, timeout=10) as resp:
        body = json.load(resp)
    assert body["status"] == "success", body
    return body["data"]["result"]


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as resp:
            return resp.status == 200
    except (OSError, urllib.error.URLError):
        return False


@contextmanager
def prometheus_server(config: dict[str, Any], workdir: Path) -> Iterator[str]:
    """Prometheus with `config`, its data and log in `workdir`; yields its base URL once ready."""
    workdir.mkdir(parents=True, exist_ok=True)
    config_file = workdir / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    check = subprocess.run(["promtool", "check", "config", str(config_file)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with open(workdir / "prometheus.log", "wb") as log:
        proc = subprocess.Popen([shutil.which("prometheus") or "prometheus", f"--config.file={config_file}",
                                 f"--storage.tsdb.path={workdir / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is None and _ready(base), "Prometheus ready", READY_TIMEOUT_SECONDS, interval=0.5)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=20)
