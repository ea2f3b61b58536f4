"""End-to-end CPU benchmark with real vLLM 0.23.0, two suites.

--suite placements (default): plain vLLM vs AFD placement 'attention' vs AFD placement 'ffn'
(1 Attention rank + 2 FFN server processes) on a tiny DeepSeek-V2, and placement 'ffn' with the
FFN servers' torch expert backend instead of vLLM's kernels.

--suite serve: `vllm serve` as a user starts it (vLLM's default compilation unless --eager), on a
DeepSeek-V3-style checkpoint (hidden 512, 4 layers: one dense, three MoE with 8 routed experts of
intermediate 256, top-2, one shared expert): plain vLLM on both cores, then AFD with the Attention
engine core pinned to core 0 and one FFN server (1 rank) to core 1, one thread each, with 1 stage
and with the default 2 stages (the plugin's minimum step sizes in force). In every configuration
the `vllm serve` front end (HTTP, tokenizer, detokenizer) may run on both cores, as plain vLLM's
does; --frontend-on-attention-core adds AFD rows with the front end pinned to core 0 beside the
engine core, the layout of earlier runs. For each concurrency (--concurrency, default 8 and 64)
every configuration gets that many requests at once, --repeats times, and reports its best output
tokens/s; --rounds repeats the whole cycle of configurations (the best of all rounds counts, and
the ratios within each round give a median and spread), so a change in the machine's load hits them
all. Printed: tokens/s per configuration and the ratios S=2/S=1 and AFD/plain; and, from the
kernel's CPU accounting of each process tree during the best load (no profiler, nothing perturbed),
how busy AFD's Attention engine core and FFN server were (CPU s / wall s, 1 = its core all the
time), the Attention engine's CPU per load at S=2 against S=1 (what splitting a step costs it), and
what a perfect pipeline could reach: an AFD load's wall cannot fall below its Attention engine's
CPU time on its one core, so S=1's wall / S=2's Attention CPU bounds S=2 / S=1, and plain vLLM's
wall / the least Attention CPU bounds AFD / plain. With --trace-waits the AFD engines write stage
traces, and it prints where the Attention engine waited for replies: for each step's last one (its
last MoE layer's last stage: after that dispatch the step has nothing left to compute but combines,
so the wait is the FFN's pass for it, which no schedule of the step's micro-batches overlaps) and
for the others, and the S=2 / S=1 bound with S=2's waits for those added to its Attention CPU. With
--split-every-step, also 2 stages with every step split whatever its size: its ratio to 1 stage per
concurrency is where splitting starts to pay (the plugin's minimum step sizes).

--suite stages: plain vLLM, then AFD with 1, 2 and 3 micro-batch stages under each placement,
the Attention process on core 0 and one FFN server (1 rank) on core 1, one thread each, on a
DeepSeek-V2 large enough that attention and expert compute are several ms per layer (--hidden,
--layers and --moe-inter rescale it; --moe-inter sets the FFN side's share). Besides tokens/s
it reports, from both sides' stage traces within the generate window: the Attention side's busy
time (wall - waits for replies), the FFN side's (expert passes + replies), the overlap
efficiency (busy A + busy F) / wall (1 is serial, 2 is both sides busy all the time), the mean
FFN expert pass, the Attention-only time (outside every step's MoE span: no micro-batch can
overlap it), the steps run, what a second micro-batch costs each side, and the S=2 speedup a
perfect pipeline could reach from S=1's measured parts.

Run through the repo's environments (the vLLM venv runs the engines, this script does not
import vllm; tests/plugin on PYTHONPATH for the tests' vLLM process helpers):
    PYTHONPATH=tests/plugin AFD_VLLM_PYTHON="$(scripts/vllm-env.sh)/bin/python" \
        $(scripts/dev-env.sh)/bin/python benchmarks/e2e_cpu.py
All prompts are scheduled together (the scheduler's limits are raised to the whole batch), so
one decode step yields one token per prompt: tokens/s
= prompts x max_tokens / generate time; mean step latency = generate time / max_tokens.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from operator import attrgetter
from pathlib import Path
from typing import NamedTuple

from afd_devcluster.checkpoints import VOCAB, write_vllm_checkpoint
from afd_shared_experts.trace import read_traces
from plugin_harness import child_pids
from trace_reading import (ReplyWaits, attention_only_seconds, attention_steps, busy_seconds, expert_passes,
                           reply_waits)
from vllm_harness import (SPLIT_EVERY_STEP, afd_block, free_port, http_status, install_testbed_plugin, post_json,
                          run_driver, served_model, start_ffn_servers, start_vllm_serve, wait_until)

ATTENTION_CORE, FFN_CORE = {0}, {1}


def overlap_bound(name: str, wall: float, one: tuple) -> str:
    """The S=2 speedup a perfect pipeline could reach from S=1's measured parts: the
    Attention-only part stays serial, and the MoE spans shrink to the longer side's busy time
    (no cost per extra micro-batch, no fill or drain inside a step)."""
    (busy_a, busy_f), _, alone, _ = one
    in_spans = busy_a - alone
    return (f"{name}: S=1 spends {alone:.2f} s of {wall:.2f} s ({100 * alone / wall:.0f}%) Attention-only; with "
            f"busy A {in_spans:.2f} s and busy F {busy_f:.2f} s inside the MoE spans, perfect overlap bounds S=2 "
            f"at {wall / (alone + max(in_spans, busy_f)):.2f}x of S=1")


def split_costs(name: str, one: tuple, two: tuple, steps: int) -> str:
    """What a second micro-batch costs each side, from the S=1 and S=2 rows of one placement,
    modelling a side's time per step as (fixed cost per micro-batch) x stages + (cost per row)
    x rows: the Attention side's extra busy time per forward step (``steps``: as the S=1 run
    counted them, more than the new tokens when requests were held back), and the fixed part of
    an FFN pass (a in a + b x rows, from the mean passes at both row counts)."""
    attention_extra = 1000 * (two[0][0] - one[0][0]) / steps
    (ms_one, rows_one), (ms_two, rows_two) = one[1], two[1]
    per_row = (ms_one - ms_two) / (rows_one - rows_two)
    fixed = ms_one - per_row * rows_one
    return (f"{name}: a second micro-batch adds {attention_extra:.1f} ms per step to the Attention side "
            f"({100 * attention_extra / (1000 * one[0][0] / steps):.0f}% of its S=1 busy time per step); an FFN "
            f"pass costs {fixed:.2f} ms + {1000 * per_row:.1f} us per row (fixed part {100 * fixed / ms_one:.0f}% of "
            f"the S=1 pass over {rows_one:.0f} rows)")


def held_back(name: str, steps: int, new_tokens: int) -> str | None:
    """A line when vLLM's scheduler held requests back (more forward steps than new tokens, e.g.
    a KV cache one block short): the held requests then run alone, in steps too small to split,
    which dilute every stage ratio."""
    if steps <= new_tokens:
        return None
    return (f"{name}: {steps} steps for {new_tokens} new tokens: not every request ran in every step (raise "
            "--kv-cache-gib); the steps with few requests run unsplit and dilute the stage ratios")


def batch_request(args, model: Path, prompts: list[list[int]]) -> dict:
    """The driver's request: every prompt scheduled in the same steps (the scheduler's limits
    raised to the whole batch: the driver's defaults keep 8 requests per step)."""
    return {"model": str(model), "prompts": prompts, "max_tokens": args.max_tokens, "max_num_seqs": args.prompts,
            "max_num_batched_tokens": max(512, args.prompts * args.prompt_len)}


def stages_suite(args, prompts: list[list[int]], root: Path) -> int:
    heads = args.hidden // 128
    model = write_vllm_checkpoint(root / "model", "deepseek_v2", hidden=args.hidden, inter=args.moe_inter,
                                  intermediate_size=args.hidden, layers=args.layers, num_attention_heads=heads,
                                  num_key_value_heads=heads, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
                                  kv_lora_rank=256)
    request = batch_request(args, model, prompts)
    kv_cache = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    plain = run_driver(request, root, "plain", timeout=1800, cpus=ATTENTION_CORE, env=kv_cache)
    rows = [("plain vLLM (core 0)", plain, None)]
    for placement in ("attention", "ffn"):
        for stages in (1, 2, 3):
            tag = f"{placement}-s{stages}"
            traces = root / f"traces-{tag}"
            block = afd_block("attention", port=free_port(), placement=placement, ffn_ranks=1, stages=stages)
            servers = start_ffn_servers(model, block, root, count=1, tag=f"ffn-{tag}", trace_dir=traces,
                                        cpus=FFN_CORE, token_budget=request["max_num_batched_tokens"])
            try:
                result = run_driver({**request, "additional_config": block, "load_format": "afd"}, root,
                                    f"afd-{tag}", timeout=1800, trace_dir=traces, cpus=ATTENTION_CORE,
                                    env=kv_cache)
            finally:
                for proc, _ in servers:
                    proc.stop()
            recorded = read_traces(traces)
            window = result["generate_window_ns"]
            rows.append((f"AFD {placement} S={stages}", result, (busy_seconds(recorded, window),
                                                                  expert_passes(recorded, window),
                                                                  attention_only_seconds(recorded, window),
                                                                  attention_steps(recorded, window))))
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each, DeepSeek-V2 "
          f"hidden {args.hidden}, {args.layers} layers ({args.layers - 1} MoE, 8 experts top-2, 1 shared, expert "
          f"intermediate {args.moe_inter}), float32, eager, KV cache {args.kv_cache_gib} GiB; Attention on core 0, "
          "1 FFN rank on core 1, 1 thread each")
    print(f"{'configuration':<24}{'tok/s':>8}{'step ms':>9}{'busy A s':>10}{'busy F s':>10}{'overlap':>9}"
          f"{'F pass ms':>11}{'rows/pass':>11}{'A only s':>10}{'steps':>7}{'ids = plain':>13}")
    tokens = args.prompts * args.max_tokens
    for name, result, measured in rows:
        seconds = result["generate_seconds"]
        line = f"{name:<24}{tokens / seconds:>8.1f}{1000 * seconds / args.max_tokens:>9.1f}"
        if measured is None:
            line += f"{'':>68}"
        else:
            (busy_a, busy_f), (pass_ms, pass_rows), alone, steps = measured
            line += (f"{busy_a:>10.2f}{busy_f:>10.2f}{(busy_a + busy_f) / seconds:>9.2f}{pass_ms:>11.2f}"
                     f"{pass_rows:>11.1f}{alone:>10.2f}{steps:>7}")
        same = "" if measured is None else ("yes" if result["token_ids"] == plain["token_ids"] else "NO")
        print(line + f"{same:>13}")
    for name, _, measured in rows:
        if measured is not None and (line := held_back(name, measured[3], args.max_tokens)):
            print(line)
    by_name = {name: result["generate_seconds"] for name, result, _ in rows}
    for placement in ("attention", "ffn"):
        s1 = by_name[f"AFD {placement} S=1"]
        print(f"{placement}: tok/s S=2 / S=1 = {s1 / by_name[f'AFD {placement} S=2']:.2f}, "
              f"S=3 / S=1 = {s1 / by_name[f'AFD {placement} S=3']:.2f}")
    print(f"S=2: tok/s ffn / attention = {by_name['AFD attention S=2'] / by_name['AFD ffn S=2']:.2f}")
    measured = {name: m for name, _, m in rows}
    for placement in ("attention", "ffn"):
        one = measured[f"AFD {placement} S=1"]
        print(split_costs(placement, one, measured[f"AFD {placement} S=2"], steps=one[3]))
    for placement in ("attention", "ffn"):
        print(overlap_bound(placement, by_name[f"AFD {placement} S=1"], measured[f"AFD {placement} S=1"]))
    for name, result, m in rows:
        if m is not None and name.endswith("S=1") and sum(m[0]) < 0.5 * result["generate_seconds"]:
            print(f"{name}: overhead dominates (compute {100 * sum(m[0]) / result['generate_seconds']:.0f}% "
                  "of the step)")
    return 0


SERVE_SHAPE = dict(hidden=512, inter=256, experts=8, top_k=2, layers=4, intermediate_size=1024,
                   num_attention_heads=4, num_key_value_heads=4, qk_nope_head_dim=64, qk_rope_head_dim=64,
                   v_head_dim=128, kv_lora_rank=256)
SERVE_START_SECONDS = 900


def descendants(pid: int) -> Iterator[int]:
    """The live descendant processes of `pid`, each before its own children."""
    pending = child_pids(pid)
    while pending:
        child = pending.pop()
        yield child
        pending += child_pids(child)


def pin_descendants(pid: int, cpus: set[int]) -> int:
    """Pin every thread of every descendant process of `pid` to `cpus` (threads started later
    inherit it from their creator); returns the processes pinned. The `vllm serve` process keeps
    its own cores: its engine core is the child that does the model's work."""
    pinned = 0
    for child in descendants(pid):
        for task in Path(f"/proc/{child}/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cpus)
            except ProcessLookupError:  # a thread that ended since the listing
                pass
        pinned += 1
    return pinned


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system, all threads) `pid` has used so far; 0 once it is gone."""
    try:
        # Fields after the command name's closing parenthesis: utime and stime are the 12th and 13th.
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def tree_cpu_seconds(pid: int, *, root: bool = True) -> float:
    """CPU seconds used so far by `pid`'s live descendants, and by `pid` itself unless `root`
    is False."""
    return sum(map(process_cpu_seconds, ([pid] if root else []) + list(descendants(pid))))


class Load(NamedTuple):
    """One load's output tokens/s, wall seconds and the CPU seconds each watched process used;
    its CLOCK_MONOTONIC window (ns) and where its engines wrote stage traces (None: off)."""

    tokens_per_second: float
    wall: float
    cpu: tuple[float, ...]
    window: tuple[int, int] = (0, 0)
    trace_dir: Path | None = None


def fastest(*loads: Load | None) -> Load:
    """The load with the most tokens/s among `loads` (None: none yet)."""
    return max(filter(None, loads), key=attrgetter("tokens_per_second"))


def serve_load(port: int, prompts: list[list[int]], max_tokens: int,
               watched: tuple[Callable[[], float], ...] = ()) -> Load:
    """``prompts`` sent at once (every completion ``max_tokens`` long), with what each of
    ``watched`` (CPU seconds used so far by some processes) grew by meanwhile."""
    name = served_model(port)
    body = {"model": name, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    cpu_before = [cpu_seconds() for cpu_seconds in watched]
    started = time.monotonic_ns()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda prompt: post_json(port, "/v1/completions", {**body, "prompt": prompt}, timeout=1800),
                      prompts))
    ended = time.monotonic_ns()
    cpu = tuple(cpu_seconds() - before for cpu_seconds, before in zip(watched, cpu_before))
    wall = (ended - started) / 1e9
    return Load(len(prompts) * max_tokens / wall, wall, cpu, (started, ended))


def serve_configuration(args, model: Path, root: Path, name: str, stages: int | None, min_split: dict | None,
                        frontend_cores: set[int], loads: dict[int, list[list[int]]]) -> dict[int, Load]:
    """The best load (most tokens/s) per concurrency of one configuration (stages None: plain
    vLLM on both cores; min_split None: the plugin's default minimum step sizes; frontend_cores:
    where AFD's `vllm serve` process runs, its engine core always on the Attention core). Under
    AFD each load's CPU is (engine core, FFN server): the descendants of `vllm serve` and the
    FFN server's process tree."""
    engine = ["--dtype", "float32", "--max-model-len", str(args.prompt_len + args.max_tokens + 16),
              "--max-num-batched-tokens", str(args.token_budget), "--max-num-seqs", str(max(loads)), "--seed", "0"]
    if args.eager:
        engine.append("--enforce-eager")
    # vLLM's default compilation (the tests' engines disable dynamo to start faster).
    env = {"TORCHDYNAMO_DISABLE": "0", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
    port, procs = free_port(), []
    traces = root / f"traces-{name}" if args.trace_waits and stages is not None else None
    try:
        if stages is None:
            env["OMP_NUM_THREADS"] = "2"
            api = start_vllm_serve(model, port, root, name, engine_args=engine, env=env, cpus=ATTENTION_CORE | FFN_CORE)
        else:
            block = afd_block("attention", port=free_port(), placement="ffn", ffn_ranks=1, stages=stages,
                              min_split=min_split)
            procs += [proc for proc, _ in start_ffn_servers(model, block, root, count=1, tag=f"ffn-{name}",
                                                            cpus=FFN_CORE, token_budget=args.token_budget,
                                                            trace_dir=traces)]
            api = start_vllm_serve(model, port, root, name, block=block, engine_args=engine, env=env,
                                   cpus=frontend_cores, trace_dir=traces)
        procs.append(api)
        wait_until(lambda: http_status(port, "/health") == 200, SERVE_START_SECONDS, f"{name} serving", procs)
        if stages is not None and frontend_cores != ATTENTION_CORE and not pin_descendants(api.popen.pid,
                                                                                            ATTENTION_CORE):
            raise RuntimeError(f"{name}: `vllm serve` started no engine core process to pin")
        serve_load(port, loads[min(loads)][:2], 4)  # warm-up: the first requests of an engine compile kernels
        watched = () if stages is None else (lambda: tree_cpu_seconds(api.popen.pid, root=False),
                                             lambda: tree_cpu_seconds(procs[0].popen.pid))
        return {concurrency: fastest(*(serve_load(port, prompts, args.max_tokens, watched)._replace(trace_dir=traces)
                                       for _ in range(args.repeats)))
                for concurrency, prompts in loads.items()}
    finally:
        for proc in procs:
            proc.stop()


def serve_suite(args, root: Path) -> int:
    model = write_vllm_checkpoint(root / "model", "deepseek_v3", **SERVE_SHAPE)
    rng = random.Random(0)
    loads = {n: [[rng.randrange(3, VOCAB) for _ in range(args.prompt_len)] for _ in range(n)]
             for n in args.concurrency}
    # (name, stages, afd.min_split_tokens, front end's cores): None stages is plain vLLM, None
    # minimums the plugin's defaults.
    both = ATTENTION_CORE | FFN_CORE
    configurations = [("plain vLLM (2 cores)", None, None, both), ("AFD 1 stage", 1, None, both),
                      ("AFD 2 stages", 2, None, both)]
    if args.split_every_step:
        configurations.append(("AFD 2 stages, all split", 2, SPLIT_EVERY_STEP, both))
    if args.frontend_on_attention_core:
        configurations += [("AFD 1 stage, front end core 0", 1, None, ATTENTION_CORE),
                           ("AFD 2 stages, front end core 0", 2, None, ATTENTION_CORE)]
    best, per_round = {}, {}  # per configuration: its best load, and each round's best tokens/s, per concurrency
    for round_ in range(args.rounds):
        for index, (name, stages, min_split, frontend_cores) in enumerate(configurations):
            measured = serve_configuration(args, model, root, f"c{index}-r{round_}", stages, min_split,
                                           frontend_cores, loads)
            earlier = best.get(name, {})
            best[name] = {n: fastest(earlier.get(n), load) for n, load in measured.items()}
            per_round.setdefault(name, []).append({n: load.tokens_per_second for n, load in measured.items()})
    print(f"vllm serve, DeepSeek-V3-style (hidden 512, 4 layers, 8 routed experts of 256, top-2, 1 shared), "
          f"float32, {'eager' if args.eager else 'vLLM default compilation'}, prompts of {args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, --max-num-batched-tokens {args.token_budget}; plain on cores 0-1, "
          f"AFD Attention engine core on core 0 + 1 FFN rank on core 1, 1 thread each, the front end on cores 0-1 "
          f"unless named; best of {args.repeats} x {args.rounds} round(s), output tok/s")
    print(f"{'configuration':<32}" + "".join(f"{f'{n} requests':>14}" for n in args.concurrency))
    tps = {name: {n: load.tokens_per_second for n, load in per_load.items()} for name, per_load in best.items()}
    for name, *_ in configurations:
        print(f"{name:<32}" + "".join(f"{tps[name][n]:>14.1f}" for n in args.concurrency))
    for n in args.concurrency:
        plain, one, two = (tps[name][n] for name, *_ in configurations[:3])
        split = (f", all split / S=1 = {tps['AFD 2 stages, all split'][n] / one:.2f}" if args.split_every_step else "")
        pinned = ""
        if args.frontend_on_attention_core:
            pinned_one, pinned_two = (tps[f"AFD {s}, front end core 0"][n] for s in ("1 stage", "2 stages"))
            pinned = (f", front end on cores 0-1 / on core 0: S=1 {one / pinned_one:.2f}, "
                      f"S=2 {two / pinned_two:.2f}")
        print(f"{n} requests: S=2 / S=1 = {two / one:.2f}, AFD S=2 / plain = {two / plain:.2f}, "
              f"AFD S=1 / plain = {one / plain:.2f}{split}{pinned}")
    print(f"Ratios within each round (its best of {args.repeats}): median (min-max) of {args.rounds} round(s)",
          *(f"{n} requests: " + round_ratios(per_round, [c[0] for c in configurations[:3]], n)
            for n in args.concurrency), sep="\n")
    print("CPU of the best loads (kernel accounting): busy = CPU s / wall s of the Attention engine core (core 0) "
          "and the FFN server (core 1)")
    for n in args.concurrency:
        plain, one, two = (best[name][n] for name, *_ in configurations[:3])
        print(f"{n} requests: " + cpu_reading(plain, one, two))
    if args.trace_waits:
        print("Where the Attention engine waited for replies in the best loads (stage traces)")
        for n in args.concurrency:
            one, two = (best[name][n] for name, *_ in configurations[1:3])
            waits = [reply_waits(read_traces(load.trace_dir), load.window) for load in (one, two)]
            print(f"{n} requests: " + wait_reading(one, two, *waits))
    return 0


def round_ratios(per_round: dict[str, list[dict[int, float]]], names: list[str], n: int) -> str:
    """S=2 / S=1 and AFD / plain at ``n`` requests (names: plain, S=1, S=2), each within a round: median (min-max)."""
    (plain, one, two), parts = names, []
    for label, a, b in (("S=2 / S=1", two, one), ("AFD S=2 / plain", two, plain), ("AFD S=1 / plain", one, plain)):
        values = sorted(x[n] / y[n] for x, y in zip(per_round[a], per_round[b]))
        parts.append(f"{label} = {statistics.median(values):.2f} ({values[0]:.2f}-{values[-1]:.2f})")
    return ", ".join(parts)


def cpu_reading(plain: Load, one: Load, two: Load) -> str:
    """What the loads of plain vLLM, S=1 and S=2 (same prompts) say: each AFD side's busy share,
    the Attention engine's CPU at S=2 against S=1, and bounds from it. An AFD load's wall is at
    least its Attention engine's CPU (one core), so S=1's wall / S=2's Attention CPU bounds S=2 /
    S=1, S=1's Attention CPU bounds it if a split cost nothing, and plain's wall / the smaller of
    the two Attention CPUs bounds AFD / plain."""
    (attention_one, ffn_one), (attention_two, ffn_two) = one.cpu, two.cpu
    return (f"busy Attention S=1 {attention_one / one.wall:.2f}, S=2 {attention_two / two.wall:.2f}; "
            f"busy FFN S=1 {ffn_one / one.wall:.2f}, S=2 {ffn_two / two.wall:.2f}; "
            f"Attention CPU S=2 / S=1 = {attention_two / attention_one:.2f}; S=2 / S=1 tok/s at most "
            f"{one.wall / attention_two:.2f} with S=2's Attention CPU, "
            f"{one.wall / attention_one:.2f} if a split cost the Attention side nothing; "
            f"AFD / plain at most {plain.wall / min(attention_one, attention_two):.2f}")


def wait_reading(one: Load, two: Load, waits_one: ReplyWaits, waits_two: ReplyWaits) -> str:
    """Each AFD load's waits for replies, each step's last reply apart (the FFN's last pass of
    the step, which no schedule of its micro-batches overlaps), and the S=2 / S=1 bound with
    S=2's waits for those added to its Attention CPU."""
    def reading(name: str, load: Load, waits: ReplyWaits) -> str:
        per_step = 1000 / waits.steps
        return (f"{name} {waits.last + waits.others:.2f} s of {load.wall:.2f} s: {waits.last:.2f} s for each step's "
                f"last reply ({waits.last * per_step:.2f} ms a step over {waits.steps} steps; the FFN's pass and "
                f"reply for it {waits.last_ffn * per_step:.2f} ms), {waits.others:.2f} s for the others; neither "
                f"computing nor waiting for replies {load.wall - load.cpu[0] - waits.last - waits.others:.2f} s")
    return (f"{reading('S=1', one, waits_one)}; {reading('S=2', two, waits_two)}; S=2 / S=1 tok/s at most "
            f"{one.wall / (two.cpu[0] + waits_two.last):.2f} with S=2's Attention CPU and its waits for each step's "
            "last reply")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--suite", choices=("placements", "stages", "serve"), default="placements")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024, help="--suite stages: hidden size (a multiple of 128)")
    p.add_argument("--layers", type=int, default=4, help="--suite stages: decoder layers (the first dense, >= 2)")
    p.add_argument("--moe-inter", type=int, default=None,
                   help="--suite stages: intermediate size of each expert (default: --hidden); sets the FFN "
                        "side's share of the step")
    p.add_argument("--kv-cache-gib", type=int, default=1,
                   help="--suite stages: vLLM's CPU KV cache (VLLM_CPU_KVCACHE_SPACE), large enough that every "
                        "request runs in every step (each request takes at least one 128-token block)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 64], help="--suite serve: requests at once")
    p.add_argument("--repeats", type=int, default=2, help="--suite serve: loads per configuration and concurrency")
    p.add_argument("--rounds", type=int, default=1, help="--suite serve: cycles over the configurations")
    p.add_argument("--token-budget", type=int, default=2048,
                   help="--suite serve: --max-num-batched-tokens of the engines and the FFN server")
    p.add_argument("--eager", action="store_true", help="--suite serve: every engine with --enforce-eager")
    p.add_argument("--split-every-step", action="store_true",
                   help="--suite serve: also AFD 2 stages with every step split (min_split_tokens 1), the "
                        "measurement the plugin's minimum step sizes come from")
    p.add_argument("--trace-waits", action="store_true",
                   help="--suite serve: AFD engines write stage traces (a line per dispatch, wait and combine, so "
                        "they run slightly slower), read to print where the Attention engine waited for replies")
    p.add_argument("--frontend-on-attention-core", action="store_true",
                   help="--suite serve: also AFD 1 and 2 stages with the `vllm serve` front end pinned to the "
                        "Attention engine's core (by default it may use both cores, as plain vLLM's does)")
    args = p.parse_args()
    if args.suite == "serve":
        if min(args.concurrency + [args.repeats, args.rounds, args.token_budget]) < 1:
            p.error("--concurrency, --repeats, --rounds and --token-budget must be >= 1")
        install_testbed_plugin()
        with tempfile.TemporaryDirectory() as tmp:
            return serve_suite(args, Path(tmp))
    if args.hidden % 128:
        p.error(f"--hidden: must be a multiple of 128 (got {args.hidden})")
    if args.layers < 2:
        p.error(f"--layers: must be at least 2, one dense and one MoE layer (got {args.layers})")
    if args.moe_inter is None:
        args.moe_inter = args.hidden
    if args.moe_inter < 1:
        p.error(f"--moe-inter: must be positive (got {args.moe_inter})")
    if args.kv_cache_gib < 1:
        p.error(f"--kv-cache-gib: must be at least 1 (got {args.kv_cache_gib})")
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    install_testbed_plugin()
    if args.suite == "stages":
        with tempfile.TemporaryDirectory() as tmp:
            return stages_suite(args, prompts, Path(tmp))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_vllm_checkpoint(root / "model", "deepseek_v2")
        request = batch_request(args, model, prompts)
        runs = (("plain vLLM", None, "vllm"), ("AFD placement attention", "attention", "vllm"),
                ("AFD placement ffn", "ffn", "vllm"), ("AFD ffn, torch experts", "ffn", "torch"))
        for name, placement, backend in runs:
            if placement is None:
                result = run_driver(request, root, "plain")
            else:
                tag = f"{placement}-{backend}"
                block = afd_block("attention", port=free_port(), placement=placement)
                servers = start_ffn_servers(model, block, root, tag=f"ffn-{tag}",
                                            extra_args=("--expert-backend", backend),
                                            token_budget=request["max_num_batched_tokens"])
                try:
                    result = run_driver({**request, "additional_config": block}, root, f"afd-{tag}")
                finally:
                    for proc, _ in servers:
                        proc.stop()
            seconds = result["generate_seconds"]
            same = "" if not rows else ("yes" if result["token_ids"] == rows[0][-1] else "NO")
            rows.append((name, args.prompts * args.max_tokens / seconds, 1000 * seconds / args.max_tokens,
                         result["parameter_bytes"][0], same, result["token_ids"]))
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each, float32, eager")
    print(f"{'configuration':<26}{'tok/s':>9}{'step ms':>10}{'attn param B':>14}{'ids = plain':>13}")
    for name, tps, step_ms, param_bytes, same, _ in rows:
        print(f"{name:<26}{tps:>9.1f}{step_ms:>10.1f}{param_bytes:>14}{same:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
