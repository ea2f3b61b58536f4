"""The prepared accelerator check (scripts/device-check.sh) and the before/after benchmarks of
the data plane run as commands: argument handling, the clear failure without a CUDA device, and
the whole check on the CPU (small sizes), so no script is first run on a lent device; and the
serve benchmark's CPU accounting."""

import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from afd_devcluster.ports import port_span_base

REPO = Path(__file__).resolve().parents[2]


def run(command: list[str], *, hide_cuda: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    if hide_cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CUDA build of torch then sees no device
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)


def test_device_check_fails_clearly_without_a_cuda_device():
    proc = run([str(REPO / "scripts/device-check.sh")])
    assert proc.returncode == 1
    assert "device-check failed: no CUDA device (torch.cuda.is_available() is False)" in proc.stderr


def test_device_check_names_a_bad_argument():
    proc = run([str(REPO / "scripts/device-check.sh"), "--device", "cpu", "--ffn-ranks", "3"])
    assert proc.returncode == 2
    assert "--ffn-ranks must divide 32" in proc.stderr
    proc = run([str(REPO / "scripts/device-check.sh"), "--steps", "0"])
    assert proc.returncode == 2
    assert "--steps must be >= 1 (got 0)" in proc.stderr
    proc = run([str(REPO / "scripts/device-check.sh"), "--device", "npu"])
    assert proc.returncode == 2
    assert "--device: invalid choice: 'npu'" in proc.stderr


def test_device_check_passes_on_the_cpu():
    """Step 1 is the real selfcheck: rank processes and the P2PConnector, whose auto rule
    picks the staged plane for ranks sharing a device; then the custom-op layer's timing table
    (eager only: no graphs on the CPU)."""
    proc = run([str(REPO / "scripts/device-check.sh"), "--device", "cpu", "--tokens", "9", "--steps", "3",
                "--timing-tokens", "1", "4", "--repeats", "1", "--port", str(port_span_base())])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == ("self-check on cpu: 1 Attention + 1 FFN rank processes on one device, real P2PConnector, "
                        "9 tokens, 3 steps")
    checked = [line.split() for line in lines if "ok, max relative error" in line]
    assert [row[:3] for row in checked] == [[placement, partition, dtype]
                                           for placement, partition in [("ffn", "affinity"), ("ffn", "contiguous"),
                                                                        ("attention", "affinity")]
                                           for dtype in ("float32:", "bfloat16:", "float16:")]
    assert all(" ".join(row[-3:]) == "staged data plane" for row in checked)
    assert lines[-1] == "device-check ok"
    timing_rows = [line.split() for line in lines[lines.index(next(l for l in lines if l.startswith("    T"))) + 1:-1]]
    assert [(row[0], row[1], row[3], row[4]) for row in timing_rows] == [
        (tokens, partition, "-", "-") for tokens in ("1", "4") for partition in ("affinity", "contiguous")]
    assert "timeout 480" in (REPO / "scripts/device-check.sh").read_text()


def test_overhead_benchmark_runs_before_and_after_side_by_side():
    """With this checkout as its own baseline: one row per (T, partition), no host read in
    dispatch and combine."""
    package = REPO / "plugin" / "afd_shared_experts"
    proc = run([sys.executable, str(REPO / "benchmarks/remote_moe_overhead.py"), "--baseline", str(package),
                "--tokens", "1", "3", "--repeats", "1"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("1", "affinity"), ("1", "contiguous"), ("3", "affinity"),
                                           ("3", "contiguous")]
    assert all(r[-2:] == ["0", "0"] for r in rows)
    proc = run([sys.executable, str(REPO / "benchmarks/remote_moe_overhead.py"), "--baseline", str(REPO)])
    assert proc.returncode == 2
    assert "--baseline:" in proc.stderr and "holds no attention.py" in proc.stderr


def test_round_trip_benchmark_alternates_two_worlds_in_one_pair_of_rank_processes():
    """With this checkout as its own baseline: before, after and ratio rows per T, every
    column measured (a span missing from the traces would fail the script)."""
    package = REPO / "plugin" / "afd_shared_experts"
    proc = run([sys.executable, str(REPO / "benchmarks/connector_round_trip.py"), "--baseline", str(package),
                "--tokens", "3", "--steps", "25"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[2:]]
    assert [r[:2] for r in rows] == [["3", "before"], ["3", "after"], ["3", "ratio"]]
    assert all(len(r) == 7 and all(float(v) > 0 for v in r[2:]) for r in rows)
    proc = run([sys.executable, str(REPO / "benchmarks/connector_round_trip.py"), "--baseline", str(REPO)])
    assert proc.returncode == 2 and "--baseline:" in proc.stderr and "no __init__.py" in proc.stderr
    proc = run([sys.executable, str(REPO / "benchmarks/connector_round_trip.py"), "--baseline", str(package),
                "--steps", "20"])
    assert proc.returncode == 2 and "--steps must be more than 20" in proc.stderr


@pytest.fixture
def e2e(monkeypatch):
    """benchmarks/e2e_cpu.py as a module (its sibling trace_reading.py importable, as when run)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("e2e_cpu", REPO / "benchmarks" / "e2e_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_benchmark_reads_each_process_trees_cpu_from_the_kernel(e2e):
    spin = "import time\nend = time.process_time() + 0.6\nwhile time.process_time() < end: pass\ntime.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", spin])
    try:
        deadline = time.monotonic() + 60
        while e2e.tree_cpu_seconds(child.pid) < 0.6 and time.monotonic() < deadline:
            time.sleep(0.05)
        spun = e2e.tree_cpu_seconds(child.pid)
        assert 0.6 <= spun < 2.0
        descendants = e2e.tree_cpu_seconds(os.getpid(), root=False)
        assert descendants >= spun
        own = e2e.tree_cpu_seconds(os.getpid()) - e2e.tree_cpu_seconds(os.getpid(), root=False)
        assert own == pytest.approx(time.process_time(), abs=0.2)
    finally:
        child.kill()
        child.wait()
    assert e2e.tree_cpu_seconds(child.pid) == 0.0  # gone: nothing to read


def test_serve_benchmark_bounds_afd_by_its_attention_engines_cpu(e2e):
    plain = e2e.Load(tokens_per_second=160.0, wall=6.0, cpu=())
    one = e2e.Load(tokens_per_second=100.0, wall=10.0, cpu=(7.4, 2.5))
    two = e2e.Load(tokens_per_second=110.0, wall=9.0, cpu=(8.0, 2.7))
    assert e2e.cpu_reading(plain, one, two) == (
        "busy Attention S=1 0.74, S=2 0.89; busy FFN S=1 0.25, S=2 0.30; Attention CPU S=2 / S=1 = 1.08; "
        "S=2 / S=1 tok/s at most 1.25 with S=2's Attention CPU, 1.35 if a split cost the Attention side nothing; "
        "AFD / plain at most 0.81")


def test_serve_benchmark_reports_each_rounds_ratio_as_median_and_spread(e2e):
    """Each ratio within one round, then their median and range: a round slowed throughout
    moves both of its configurations, not the ratio."""
    per_round = {"S=2": [{64: 130.0}, {64: 60.0}, {64: 120.0}], "S=1": [{64: 100.0}, {64: 50.0}, {64: 100.0}],
                 "plain": [{64: 200.0}, {64: 200.0}, {64: 200.0}]}
    assert e2e.round_ratios(per_round, ["plain", "S=1", "S=2"], 64) == (
        "S=2 / S=1 = 1.20 (1.20-1.30), AFD S=2 / plain = 0.60 (0.30-0.65), AFD S=1 / plain = 0.50 (0.25-0.50)")


def test_stages_benchmark_says_when_the_scheduler_held_requests_back(e2e):
    assert e2e.held_back("AFD ffn S=2", 32, 32) is None
    assert e2e.held_back("AFD ffn S=2", 64, 32) == (
        "AFD ffn S=2: 64 steps for 32 new tokens: not every request ran in every step (raise --kv-cache-gib); the "
        "steps with few requests run unsplit and dilute the stage ratios")


def test_stages_benchmark_costs_a_split_per_forward_step(e2e):
    one = ((16.0, 16.0), (44.0, 624.0), 3.0, 32)  # (busy A, busy F), (pass ms, rows), A only, steps
    two = ((18.0, 17.5), (24.0, 312.0), 2.0, 32)
    assert e2e.split_costs("ffn", one, two, steps=32) == (
        "ffn: a second micro-batch adds 62.5 ms per step to the Attention side (12% of its S=1 busy time per step); "
        "an FFN pass costs 4.00 ms + 64.1 us per row (fixed part 9% of the S=1 pass over 624 rows)")


def _interval(role: str, kind: str, step: int, layer: int, stage: int, start_us: int, length_us: int) -> dict:
    return {"role": role, "kind": kind, "step": step, "layer": layer, "stage": stage,
            "start_ns": 1000 * start_us, "end_ns": 1000 * (start_us + length_us)}


def test_serve_benchmark_finds_where_the_attention_side_waited_for_replies(e2e):
    traces = [
        # step 5, two stages: layer 2's stage 1 waits a little, layer 3's stage 0 too, stage 1 is the last reply
        _interval("attention", "combine_wait", 5, 2, 1, 100, 300),
        _interval("attention", "combine_wait", 5, 3, 0, 1000, 500),
        _interval("ffn", "expert_pass", 5, 3, 1, 1200, 1500),
        _interval("ffn", "reply", 5, 3, 1, 2700, 100),
        _interval("attention", "combine_wait", 5, 3, 1, 1700, 2000),
        _interval("ffn", "expert_pass", 5, 3, 0, 600, 900),  # not the last
        # step 6, one stage
        _interval("attention", "combine_wait", 6, 3, 0, 5000, 400),
        _interval("ffn", "expert_pass", 6, 3, 0, 4800, 500),
        # step 9 began its wait after the window
        _interval("attention", "combine_wait", 9, 3, 0, 9000, 100),
        _interval("ffn", "expert_pass", 9, 3, 0, 8800, 300),
    ]
    waits = e2e.reply_waits(traces, (0, 8_000_000))
    with pytest.raises(ValueError, match=r"no Attention rank's wait for a reply began in the window \(10 intervals"):
        e2e.reply_waits(traces, (10_000_000, 20_000_000))
    assert waits.steps == 2
    assert waits.last == pytest.approx(0.0024)  # 2000 + 400 us
    assert waits.others == pytest.approx(0.0008)
    assert waits.last_ffn == pytest.approx(0.0021)  # step 5: 1500 + 100 us, step 6: 500 us
    one = e2e.Load(tokens_per_second=100.0, wall=10.0, cpu=(7.4, 2.5))
    two = e2e.Load(tokens_per_second=110.0, wall=9.0, cpu=(8.0, 2.7))
    later = e2e.ReplyWaits(steps=100, last=0.5, others=0.2, last_ffn=0.45)
    assert e2e.wait_reading(one, two, waits, later) == (
        "S=1 0.00 s of 10.00 s: 0.00 s for each step's last reply (1.20 ms a step over 2 steps; the FFN's pass and "
        "reply for it 1.05 ms), 0.00 s for the others; neither computing nor waiting for replies 2.60 s; S=2 0.70 s "
        "of 9.00 s: 0.50 s for each step's last reply (5.00 ms a step over 100 steps; the FFN's pass and reply for it "
        "4.50 ms), 0.20 s for the others; neither computing nor waiting for replies 0.30 s; S=2 / S=1 tok/s at most "
        "1.18 with S=2's Attention CPU and its waits for each step's last reply")
