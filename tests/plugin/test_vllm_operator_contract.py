"""No drift between the operator's rendered pods and the plugin's own parsing.

Every example in examples/ is validated, planned and rendered with the operator's code; each
pod's command line goes through the FFN server's argparse or the Attention-side rank
derivation, and its afd block through parse_afd_config. Runs in the dev venv (no vLLM).
"""

import argparse
import json
import shlex
from pathlib import Path

import pytest
import yaml

from afd_operator.planner import plan
from afd_operator.render import render
from afd_operator.validation import validate_object
from afd_shared_experts import ffn_server
from afd_shared_experts.config import AFDConfigError, parse_afd_config
from afd_shared_experts.roles import attention_role_rank, ffn_world_ranks

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def vllm_serve_args(command: list[str]) -> argparse.Namespace:
    """The subset of `vllm serve` flags that fixes an Attention pod's place in the AFD world."""
    assert command[:2] == ["vllm", "serve"], command
    p = argparse.ArgumentParser()
    p.add_argument("model")
    for flag in ("--tensor-parallel-size", "--data-parallel-size", "--data-parallel-size-local",
                 "--data-parallel-start-rank"):
        p.add_argument(flag, type=int)
    p.add_argument("--data-parallel-address")
    p.add_argument("--headless", action="store_true")
    p.add_argument("--load-format")
    p.add_argument("--additional-config", required=True)
    args, _ = p.parse_known_args(command[2:])
    return args


def instance_pods(path: Path):
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    for doc in docs:
        doc.setdefault("metadata", {}).setdefault("namespace", "ns")
        obj, problems = validate_object(doc)
        assert not problems, (path.name, problems)
        pods = [o for o in render(obj.spec, plan(obj.spec, obj.metadata.name, "ns"), owner_uid="u")
                if o["kind"] == "Pod"]
        by_instance = {}
        for pod in pods:
            by_instance.setdefault(pod["spec"]["subdomain"], []).append(pod)
        yield from by_instance.items()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_rendered_pods_agree_with_plugin_parsing(example):
    instances = list(instance_pods(example))
    assert instances
    for instance, pods in instances:
        attention_ranks, ffn_ranks, endpoints = [], [], set()
        for pod in pods:
            command = pod["spec"]["containers"][0]["command"]
            role = pod["spec"]["containers"][0]["name"]
            if role == "ffn":
                args, cfg, world = ffn_server.parse_args(command[3:])
                assert command[:3] == ["python3", "-m", "afd_shared_experts.ffn_server"]
                ffn_ranks += world
            else:
                args = vllm_serve_args(command)
                cfg = parse_afd_config(json.loads(args.additional_config))
                # The plugin's loader (vllm.loader.LOAD_FORMAT): no routed expert read from disk.
                assert args.load_format == "afd", shlex.join(command)
                assert args.data_parallel_address == cfg.host, "the DP address and the connector host are the head"
                start = args.data_parallel_start_rank if args.headless else 0
                assert args.headless == (start != 0), shlex.join(command)
                for dp_rank in range(start, start + args.data_parallel_size_local):
                    for tp_rank in range(args.tensor_parallel_size):
                        attention_ranks.append(attention_role_rank(
                            cfg, dp_rank=dp_rank, dp_size=args.data_parallel_size, tp_rank=tp_rank,
                            tp_size=args.tensor_parallel_size))
            assert cfg.role == role
            endpoints.add((cfg.host, cfg.port, cfg.num_attention_ranks, cfg.num_ffn_ranks,
                           cfg.shared_experts.placement))
        assert len(endpoints) == 1, f"{instance}: pods disagree on host/port/world/placement: {endpoints}"
        num_attention, num_ffn = next(iter(endpoints))[2:4]
        # Every world rank is held exactly once: Attention 0..A-1, FFN A..A+F-1.
        assert sorted(attention_ranks) == list(range(num_attention)), instance
        assert sorted(ffn_ranks) == list(range(num_attention, num_attention + num_ffn)), instance


def test_rank_derivation_rejects_a_topology_the_afd_block_does_not_describe():
    cfg = parse_afd_config({"afd": {"role": "attention", "num_attention_ranks": 4, "num_ffn_ranks": 2,
                                    "connector_extra_config": {"attn_ranks_per_dp": 2}}})
    assert attention_role_rank(cfg, dp_rank=1, dp_size=2, tp_rank=1, tp_size=2) == 3
    with pytest.raises(AFDConfigError, match="afd.num_attention_ranks: must equal"):
        attention_role_rank(cfg, dp_rank=0, dp_size=4, tp_rank=0, tp_size=2)
    with pytest.raises(AFDConfigError, match="afd.connector_extra_config.attn_ranks_per_dp"):
        attention_role_rank(cfg, dp_rank=0, dp_size=1, tp_rank=0, tp_size=4)
    ffn = parse_afd_config({"afd": {"role": "ffn", "num_attention_ranks": 4, "num_ffn_ranks": 2}})
    assert ffn_world_ranks(ffn, rank_start=1, local_ranks=1) == [5]
    with pytest.raises(AFDConfigError, match=r"afd.num_ffn_ranks: must cover the server's FFN ranks \[1, 3\)"):
        ffn_world_ranks(ffn, rank_start=1, local_ranks=2)
