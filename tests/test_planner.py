"""Planner: rank layout, DP start ranks, endpoints, runtime config, revisions (pure)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from afd_operator.api import AFDDeploymentSpec
from afd_operator.planner import plan
from afd_operator.revision import revision_of, shaping_spec
from afd_operator.validation import validate_object
from afd_operator.render import additional_config_json
from afd_shared_experts.config import (DEFAULT_MIN_SPLIT_DECODE_TOKENS, DEFAULT_MIN_SPLIT_PREFILL_TOKENS, AFDConfig,
                                       AFDConfigError, SharedExpertsConfig, parse_afd_config)


def spec_of(**overrides: Any) -> AFDDeploymentSpec:
    data: dict[str, Any] = {
        "replicas": 2,
        "image": "runtime:v1",
        "model": {"name": "m", "path": "/models/m"},
        "attention": {"dataParallel": 2, "tensorParallel": 2, "devicesPerPod": 2},
        "ffn": {"ranks": 4, "devicesPerPod": 2},
    }
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    return AFDDeploymentSpec.model_validate(data)


def option_value(command: tuple[str, ...], flag: str) -> str:
    return command[command.index(flag) + 1]


TOPOLOGIES = [
    # (dp, tp, attention devices/pod, ffn ranks, ffn devices/pod)
    (1, 1, 1, 1, 1),
    (2, 1, 1, 2, 1),
    (4, 4, 16, 16, 16),
    (2, 2, 2, 4, 2),
    (8, 2, 4, 32, 8),
    (3, 1, 8, 3, 8),
]


@pytest.mark.parametrize("dp,tp,adev,franks,fdev", TOPOLOGIES)
def test_every_world_rank_held_exactly_once(dp: int, tp: int, adev: int, franks: int, fdev: int) -> None:
    spec = spec_of(attention={"dataParallel": dp, "tensorParallel": tp, "devicesPerPod": adev},
                   ffn={"ranks": franks, "devicesPerPod": fdev})
    p = plan(spec, "ds", "ns")
    a = dp * tp
    for inst in p.instances:
        held: list[int] = []
        for pod in inst.pods:
            held += list(range(pod.world_rank_start, pod.world_rank_start + pod.ranks))
        assert sorted(held) == list(range(a + franks))
        attn = inst.pods_of("attention")
        assert [pod.head for pod in attn] == [True] + [False] * (len(attn) - 1)
        # DP start ranks tile 0..dp-1 and match the command line.
        starts = [pod.dp_start_rank for pod in attn]
        assert starts == [k * (attn[0].ranks // tp) for k in range(len(attn))]
        assert sum(pod.dp_local for pod in attn) == dp
        for pod in attn:
            assert option_value(pod.command, "--data-parallel-size-local") == str(pod.dp_local)
            assert ("--headless" in pod.command) == (not pod.head)
            if not pod.head:
                assert option_value(pod.command, "--data-parallel-start-rank") == str(pod.dp_start_rank)
        for pod in inst.pods_of("ffn"):
            assert option_value(pod.command, "--ffn-rank-start") == str(pod.rank_start)
            assert option_value(pod.command, "--ffn-local-ranks") == str(pod.ranks)


def test_runtime_config_agrees_across_an_instance() -> None:
    spec = spec_of(connector={"extraConfig": {"dynamicQuant": 1}}, sharedExperts={"placement": "attention"})
    p = plan(spec, "ds", "ns")
    for inst in p.instances:
        for pod in inst.pods:
            # The plugin's own config type, every field set from the spec or the plugin's default.
            assert pod.afd_config == AFDConfig(
                role=pod.role, num_attention_ranks=4, num_ffn_ranks=4, host=inst.head_host,
                port=inst.ports.connector, attn_ranks_per_dp=2, dynamic_quant=1,
                shared_experts=SharedExpertsConfig(placement="attention", partition="affinity"),
                rendezvous_timeout_seconds=1800.0)  # startup.timeoutSeconds
        assert sorted(pod.afd_config.role for pod in inst.pods) == ["attention", "attention", "ffn", "ffn"]
        heads = [pod for pod in inst.pods if pod.head]
        assert len(heads) == 1 and inst.head_host.startswith(heads[0].name + "." + inst.name + ".ns.svc.")
        # Attention DP address is the head's DNS name too; every rank uses the same batch budget.
        for pod in inst.pods:
            assert option_value(pod.command, "--max-num-batched-tokens") == "8192"
            if pod.role == "attention":
                assert option_value(pod.command, "--data-parallel-address") == inst.head_host


def test_host_network_shifts_ports_per_instance_and_pod_network_does_not() -> None:
    p = plan(spec_of(replicas=3), "ds", "ns")
    assert [i.ports.connector for i in p.instances] == [1239, 1255, 1271]
    assert [i.ports.api for i in p.instances] == [8000, 8016, 8032]
    assert [pod.afd_config.port for pod in p.instances[2].pods] == [1271] * 4
    cpu = plan(spec_of(replicas=3, platform="cpu"), "ds", "ns")
    assert {i.ports.connector for i in cpu.instances} == {1239}


def test_pods_of_one_role_share_ports_no_ordinal_offset() -> None:
    """Host ports shift per instance only: FFN pods of one instance declare the same ports (so
    the scheduler's host-port check keeps them on different nodes), the head alone declares
    the Attention ports and headless Attention pods declare none (they may share any node)."""
    p = plan(spec_of(replicas=2, ffn={"ranks": 8, "devicesPerPod": 2}), "ds", "ns")
    for inst in p.instances:
        shift = inst.index * 16
        ffn_ports = {pod.ports for pod in inst.pods_of("ffn")}
        assert len(inst.pods_of("ffn")) == 4
        assert ffn_ports == {(("health", 9401 + shift), ("metrics", 9400 + shift))}
        head, *headless = inst.pods_of("attention")
        assert head.ports == (("api", 8000 + shift), ("dp-rpc", 13345 + shift), ("connector", 1239 + shift))
        assert headless and all(pod.ports == () for pod in headless)


def test_a_spec_the_plugin_refuses_cannot_be_planned() -> None:
    with pytest.raises(AFDConfigError, match=r"^afd\.connector_extra_config\.foo: unknown key"):
        plan(spec_of(connector={"extraConfig": {"foo": 1}}), "ds", "ns")


def test_plan_is_deterministic_and_instances_selectable() -> None:
    spec = spec_of()
    assert plan(spec, "ds", "ns") == plan(spec, "ds", "ns")
    some = plan(spec, "ds", "ns", indices=[5, 2])
    assert [i.index for i in some.instances] == [2, 5]
    assert some.instances[1].name == f"ds-{some.revision}-5"


def test_revision_ignores_operator_only_fields() -> None:
    base = revision_of(spec_of())
    assert revision_of(spec_of(replicas=7)) == base
    assert revision_of(spec_of(updateStrategy={"maxSurge": 3, "paused": True})) == base
    assert revision_of(spec_of(recovery={"maxRestarts": 1}, startup={"order": "Parallel"})) == base
    assert revision_of(spec_of(service={"type": "NodePort"}, metrics={"podMonitor": True})) == base


@pytest.mark.parametrize("change", [
    {"image": "runtime:v2"},
    {"sharedExperts": {"placement": "attention"}},
    {"attention": {"dataParallel": 4}},
    {"ffn": {"ranks": 8}},
    {"connector": {"port": 2000}},
    {"model": {"maxNumBatchedTokens": 4096}},
    {"attention": {"env": [{"name": "X", "value": "1"}]}},
    {"async": {"stages": 1}},
    {"async": {"minSplitTokens": {"decode": 8}}},
])
def test_revision_changes_with_anything_that_shapes_an_instance(change: dict[str, Any]) -> None:
    assert revision_of(spec_of(**change)) != revision_of(spec_of())


def test_revision_is_stable_across_defaults_spelled_out() -> None:
    explicit = spec_of(sharedExperts={"placement": "ffn", "partition": "affinity"}, platform="ascend")
    assert revision_of(explicit) == revision_of(spec_of())


def test_async_at_its_defaults_leaves_the_revision_as_before_the_block_existed() -> None:
    # The hashed data of a spec without `async` (or with its defaults spelled out) has no such
    # key, as before spec.async existed: an operator upgrade does not roll those instances.
    assert "async" not in shaping_spec(spec_of())
    defaults = {"decode": DEFAULT_MIN_SPLIT_DECODE_TOKENS, "prefill": DEFAULT_MIN_SPLIT_PREFILL_TOKENS}
    assert "async" not in shaping_spec(spec_of(**{"async": {"minSplitTokens": defaults}}))
    assert shaping_spec(spec_of(**{"async": {"stages": 2}}))["async"] == {"stages": 2, "minSplitTokens": defaults}


def test_examples_plan(examples: list) -> None:
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            obj, problems = validate_object(doc)
            assert problems == [], (path, problems)
            p = plan(obj.spec, obj.metadata.name, obj.metadata.namespace)
            assert len(p.instances) == obj.spec.replicas
            assert all(len(name) <= 63 for i in p.instances for name in [i.name, *(pod.name for pod in i.pods)])


@pytest.mark.parametrize("overrides, stages", [
    ({"platform": "cpu"}, 2),  # the default where the stage rule allows it
    ({"platform": "cpu", "sharedExperts": {"placement": "attention"}}, 1),  # little to overlap on the FFN side
    ({"platform": "cpu", "sharedExperts": {"placement": "attention"}, "async": {"stages": 2}}, 2),
    ({}, 1),  # ascend: the stage rule allows 1
    ({"platform": "cpu", "attention": {"engineArgs": ["--pipeline-parallel-size", "2"]}}, 1),
    ({"platform": "cpu", "attention": {"engineArgs": ["--enable-dbo"]}}, 1),
    ({"platform": "cpu", "model": {"name": "m", "path": "/models/m", "maxNumBatchedTokens": 1}}, 1),
    ({"platform": "cpu", "async": {"stages": 1}}, 1),
    ({"platform": "cpu", "async": {"stages": 3}}, 3),
    ({"platform": "cpu", "async": {"stages": 2}, "attention": {"engineArgs": ["--pipeline-parallel-size", "1"]}}, 2),
])
def test_both_roles_get_the_micro_batch_stage_count(overrides: dict, stages: int) -> None:
    for inst in plan(spec_of(**overrides), "ds", "ns").instances:
        assert {pod.afd_config.num_stages for pod in inst.pods} == {stages}
        # What the pods read back from their command line.
        for pod in inst.pods:
            assert parse_afd_config(json.loads(additional_config_json(pod))).num_stages == stages


def test_both_roles_get_the_stage_split_minimums() -> None:
    spec = spec_of(platform="cpu", **{"async": {"minSplitTokens": {"decode": 4, "prefill": 96}}})
    for inst in plan(spec, "ds", "ns").instances:
        for pod in inst.pods:
            minimums = parse_afd_config(json.loads(additional_config_json(pod))).min_split_tokens
            assert (minimums.decode, minimums.prefill) == (4, 96)
    defaults = parse_afd_config(json.loads(additional_config_json(plan(spec_of(), "ds", "ns").instances[0].pods[0])))
    assert (defaults.min_split_tokens.decode, defaults.min_split_tokens.prefill) == (
        DEFAULT_MIN_SPLIT_DECODE_TOKENS, DEFAULT_MIN_SPLIT_PREFILL_TOKENS)
