"""Time plan + render for AFD topologies from 2 to 1024 ranks per instance and 1..16 instances.

Prints one table; microseconds per pod show whether cost grows linearly with the number of
pods. Each row is measured with Python's cyclic garbage collector on (as the operator runs)
and off, side by side: the collector's full passes grow with the live heap, which is what
bends the largest rows. Run: `$(scripts/dev-env.sh)/bin/python benchmarks/plan_render.py`.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from afd_operator.api import AFDDeploymentSpec
from afd_operator.planner import plan
from afd_operator.render import render
from afd_operator.validation import check_spec

DEVICES_PER_POD = 8


def spec_for(ranks_per_instance: int, instances: int) -> AFDDeploymentSpec:
    half = ranks_per_instance // 2
    tp = min(4, half)
    return AFDDeploymentSpec.model_validate({
        "replicas": instances,
        "image": "runtime:v1",
        "model": {"name": "m", "path": "/models/m", "routedExperts": 1024},
        "attention": {"dataParallel": half // tp, "tensorParallel": tp, "devicesPerPod": DEVICES_PER_POD},
        "ffn": {"ranks": half, "devicesPerPod": DEVICES_PER_POD},
    })


def measure(spec: AFDDeploymentSpec, repeats: int) -> tuple[float, int]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        assert not check_spec(spec, "bench")
        objs = render(spec, plan(spec, "bench", "ns"), owner_uid="uid")
        samples.append(time.perf_counter() - start)
    pods = sum(1 for o in objs if o["kind"] == "Pod")
    return statistics.median(samples), pods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="runs per row (median is printed)")
    args = parser.parse_args()
    print("validate + plan + render, median of", args.repeats, "runs")
    print(f"{'ranks/instance':>14} {'instances':>9} {'pods':>6} {'ms':>8} {'us/pod':>8} {'ms gc off':>10} "
          f"{'us/pod gc off':>14}")
    for ranks in (2, 8, 32, 128, 512, 1024):
        for instances in (1, 4, 16):
            spec = spec_for(ranks, instances)
            seconds, pods = measure(spec, args.repeats)
            gc.disable()
            try:
                no_gc, _ = measure(spec, args.repeats)
            finally:
                gc.enable()
            print(f"{ranks:>14} {instances:>9} {pods:>6} {seconds * 1e3:>8.2f} {seconds * 1e6 / pods:>8.1f} "
                  f"{no_gc * 1e3:>10.2f} {no_gc * 1e6 / pods:>14.1f}")


if __name__ == "__main__":
    main()
