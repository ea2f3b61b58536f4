"""OpenMP threads per rank process on shared CPU cores: the same AFD instance with each process's
pool at the machine's core count (what torch picks when nothing sets it, as in a pod with
vLLM's CPU binding off) and at one thread (what the operator renders for a rank given one core
or less, planner._cpu_threads_env), measured side by side in one run.

The instance is the real node's first shape: `vllm serve` with Attention DP 2 (separate engine
and worker processes, as in the pods) and one FFN server holding 2 ranks, on a tiny
DeepSeek-V2, every process free to use every core. Each variant serves sequential completions
for --seconds; the script prints requests served and CPU seconds used by all the processes,
and the ratio of requests per CPU second between the variants.

Run through the repo's environments (this script does not import vllm; tests/plugin on
PYTHONPATH for the tests' vLLM process helpers):
    PYTHONPATH=tests/plugin AFD_VLLM_PYTHON="$(scripts/vllm-env.sh)/bin/python" \
        $(scripts/dev-env.sh)/bin/python benchmarks/cpu_threads.py
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from afd_devcluster.checkpoints import write_vllm_checkpoint
from vllm_harness import (PROMPTS, afd_block, complete, free_port, http_status, install_testbed_plugin, served_model,
                          start_ffn_servers, start_vllm_serve, wait_until)

TICKS = os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(roots: list[int]) -> float:
    """User + system CPU seconds of the live processes under `roots` (their children included)."""
    parent, used = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parent[int(entry.name)] = int(fields[1])
        used[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICKS
    tree = set(roots)
    grew = True
    while grew:
        children = {pid for pid, ppid in parent.items() if ppid in tree} - tree
        tree |= children
        grew = bool(children)
    return sum(used.get(pid, 0.0) for pid in tree)


def measure(model: Path, root: Path, threads: int, seconds: float) -> tuple[int, float]:
    """(requests served, CPU seconds) of sequential completions for `seconds`."""
    env = {"OMP_NUM_THREADS": str(threads), "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    block = afd_block("attention", port=free_port(), attention_ranks=2, ffn_ranks=2)
    servers = start_ffn_servers(model, block, root, split=(2,), env=env)
    port = free_port()
    procs = [proc for proc, _ in servers]
    try:
        procs.append(start_vllm_serve(model, port, root, "attention", block=block, data_parallel=2, env=env))
        wait_until(lambda: http_status(port, "/health") == 200, 600, "AFD vllm serve /health", procs)
        name = served_model(port)
        complete(port, name, PROMPTS[0], max_tokens=4)
        before, started, served = tree_cpu_seconds([p.popen.pid for p in procs]), time.monotonic(), 0
        while time.monotonic() - started < seconds:
            complete(port, name, PROMPTS[0], max_tokens=4)
            served += 1
        return served, tree_cpu_seconds([p.popen.pid for p in procs]) - before
    finally:
        for proc in procs:
            proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="load window of each variant")
    args = parser.parse_args()
    install_testbed_plugin()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory() as tmp:
        model = write_vllm_checkpoint(Path(tmp) / "deepseek_v2", "deepseek_v2")
        rows = {}
        for threads in (cores, 1):
            root = Path(tmp) / f"threads-{threads}"
            root.mkdir()
            rows[threads] = measure(model, root, threads, args.seconds)
    print(f"{'OMP_NUM_THREADS':>16} {'requests':>9} {'CPU s':>7} {'requests/CPU s':>15}")
    for threads, (served, cpu) in rows.items():
        print(f"{threads:>16} {served:>9} {cpu:>7.1f} {served / cpu:>15.2f}")
    (many, many_cpu), (one, one_cpu) = rows[cores], rows[1]
    print(f"one thread / {cores} threads: requests {one / many:.2f}x, requests per CPU second "
          f"{(one / one_cpu) / (many / many_cpu):.2f}x")


if __name__ == "__main__":
    main()
