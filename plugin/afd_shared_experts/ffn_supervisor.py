"""Supervisor of an FFN pod: one process per FFN rank.

``python3 -m afd_shared_experts.ffn_server --ffn-local-ranks N ...`` (the command the operator
renders) supervises N rank processes, the same module started once per rank with
``--ffn-local-ranks 1`` and a status pipe. Each rank's ``P2PConnector.init()`` is a full-mesh
rendezvous that waits for every rank of the world, so the ranks of one pod must run
concurrently; separate processes also give each rank its own interpreter (no GIL shared
between devices) and its own device.

Rank i of the pod uses device index i of the pod's visible devices (``npu:i`` / ``cuda:i``;
``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES`` are passed through unchanged, as
vLLM's workers use them), ``cpu`` on CPU.

The supervisor serves /health (200 while it runs), /ready (200 only while every rank reported
ready) and /metrics (every rank's runtime metrics, summed over the ranks through
prometheus_client's multiprocess mode, plus ``afd_ffn_rank_ready{ffn_rank}``).
SIGTERM/SIGINT are forwarded to every rank; exit 0 once all drained. A rank that exits non-zero
while the pod is not stopping stops the others and the supervisor exits 1, so the operator
recreates the instance; a rank that ended cleanly (every Attention rank shut down) stops the
others too, and the pod exits 0. Arguments are checked (exit 2) before any rank starts.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

from .metrics import ProbeServer

logger = logging.getLogger("afd_shared_experts.ffn_supervisor")

# A rank drains its work item in flight (bounded by the server's own stop timeout) before exiting.
RANK_EXIT_GRACE_SECONDS = 40.0
# Lines a rank writes on its status pipe.
STARTED_LINE, READY_LINE = "started", "ready"


def rank_device(device_name: str, local_index: int) -> str:
    """The device of the pod's local rank `local_index` (device name already resolved; one
    with an index names the device of a single-rank pod)."""
    return device_name if device_name == "cpu" or ":" in device_name else f"{device_name}:{local_index}"


def rank_argv(args: argparse.Namespace, ffn_rank: int, device: str, status_fd: int) -> list[str]:
    """Command line of one rank process: the pod's flags for a single rank, no probe server."""
    argv = [sys.executable, "-m", "afd_shared_experts.ffn_server", "--model", args.model,
            "--ffn-rank-start", str(ffn_rank), "--ffn-local-ranks", "1", "--health-port", "0",
            "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--dtype", args.dtype,
            "--expert-backend", args.expert_backend, "--additional-config", args.additional_config,
            "--device", device, "--rank-status-fd", str(status_fd)]
    for flag, value in (("--max-model-len", args.max_model_len), ("--quantization", args.quantization)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


class RankProcess:
    """One FFN rank's process and the readiness it reported on its status pipe."""

    def __init__(self, ffn_rank: int, argv_for_fd, env: dict[str, str]):
        self.ffn_rank = ffn_rank
        self.ready = False
        read_fd, write_fd = os.pipe()
        try:
            self.popen = subprocess.Popen(argv_for_fd(write_fd), env=env, pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self._reader = threading.Thread(target=self._read_status, args=(read_fd,), daemon=True,
                                        name=f"afd-ffn-rank-{ffn_rank}-status")
        self._reader.start()

    def _read_status(self, read_fd: int) -> None:
        with os.fdopen(read_fd) as pipe:
            for line in pipe:
                if line.strip() == READY_LINE:
                    self.ready = True
        self.ready = False  # the rank closed its pipe: it is exiting

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class PodMetrics:
    """/metrics of the pod: the ranks' multiprocess-mode files plus each rank's readiness."""

    def __init__(self, directory: str, ranks: list[RankProcess]):
        self._ranks = ranks
        self.registry = CollectorRegistry()
        MultiProcessCollector(self.registry, path=directory)
        self.registry.register(self)

    def collect(self):
        family = GaugeMetricFamily("afd_ffn_rank_ready", "1 while the FFN rank's process reported ready",
                                   labels=["ffn_rank"])
        for rank in self._ranks:
            family.add_metric([str(rank.ffn_rank)], 1.0 if rank.ready and rank.alive else 0.0)
        yield family

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class Supervisor:
    def __init__(self, args: argparse.Namespace, device_name: str):
        self.args, self.device_name = args, device_name
        self.ranks: list[RankProcess] = []
        self.stopping = threading.Event()
        self.probes: ProbeServer | None = None
        self.metrics_dir = tempfile.mkdtemp(prefix="afd-ffn-metrics-")

    def ready(self) -> bool:
        return (len(self.ranks) == self.args.ffn_local_ranks and not self.stopping.is_set()
                and all(rank.ready and rank.alive for rank in self.ranks))

    def start(self) -> None:
        args = self.args
        # A fresh directory per pod start: the ranks' metric files, summed by PodMetrics.
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        for local_index in range(args.ffn_local_ranks):
            if self.stopping.is_set():
                break
            ffn_rank = args.ffn_rank_start + local_index
            device = rank_device(self.device_name, local_index)
            rank = RankProcess(ffn_rank, lambda fd: rank_argv(args, ffn_rank, device, fd), env)
            logger.info("FFN rank %d: process %d on device %s", ffn_rank, rank.popen.pid, device)
            self.ranks.append(rank)
        metrics_port = args.health_port if args.metrics_port is None else args.metrics_port
        self.probes = ProbeServer(PodMetrics(self.metrics_dir, self.ranks), self.ready, args.bind_host,
                                  metrics_port, args.health_port).start()
        logger.info("probes on :%d (/health, /ready), metrics on :%d", self.probes.health_port,
                    self.probes.metrics_port)

    def forward(self, signum: int) -> None:
        self.stopping.set()
        for rank in self.ranks:
            if rank.alive:
                rank.popen.send_signal(signum)

    def wait(self) -> int:
        """Until stopped or a rank ended by itself; stop the rest; the pod's exit status."""
        status = 0
        while not self.stopping.wait(0.2):
            ended = [rank for rank in self.ranks if not rank.alive]
            if ended:
                code = ended[0].popen.returncode
                if code != 0:
                    logger.error("FFN rank %d (process %d) exited with %d: stopping the pod", ended[0].ffn_rank,
                                 ended[0].popen.pid, code)
                    status = 1
                else:
                    logger.info("FFN rank %d ended (every Attention rank shut down): stopping the pod",
                                ended[0].ffn_rank)
                self.forward(signal.SIGTERM)
        return max(status, self._reap())

    def _reap(self) -> int:
        """Wait for every rank (SIGKILL after the grace period); 1 if one failed to drain."""
        deadline = time.monotonic() + RANK_EXIT_GRACE_SECONDS
        status = 0
        for rank in self.ranks:
            try:
                code = rank.popen.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.error("FFN rank %d did not exit within %.0fs: killing it", rank.ffn_rank,
                             RANK_EXIT_GRACE_SECONDS)
                rank.popen.kill()
                code = rank.popen.wait()
            # A rank stopped before it installed its handler (still importing) held no work.
            if code not in (0, -signal.SIGTERM, -signal.SIGINT):
                status = 1
        if self.probes is not None:
            self.probes.stop()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        return status


def supervise(args: argparse.Namespace, device_name: str) -> int:
    supervisor = Supervisor(args, device_name)
    signal.signal(signal.SIGTERM, lambda signum, _frame: supervisor.forward(signum))
    signal.signal(signal.SIGINT, lambda signum, _frame: supervisor.forward(signum))
    supervisor.start()
    return supervisor.wait()
