import dataclasses
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from afd_shared_experts.config import (
    CONNECTORS, DATA_PLANES, EXTRA_KEYS, FIELDS, MAX_STAGES, NESTED, PARTITIONS, PLACEMENTS, REQUIRED, ROLES, SHARED_KEYS,
    TOP_LEVEL_KEYS, AFDConfig, AFDConfigError, MinSplitTokens, SharedExpertsConfig, parse_afd_config, stage_limit,
)

BASE = {"role": "attention", "num_attention_ranks": 4, "num_ffn_ranks": 2}


def parse(**afd):
    return parse_afd_config({"afd": {**BASE, **afd}})


def test_defaults_and_types():
    cfg = parse()
    assert (cfg.connector, cfg.async_dp, cfg.port, cfg.host) == ("p2p", True, 1239, "127.0.0.1")
    assert (cfg.shared_experts.placement, cfg.shared_experts.partition) == ("attention", "affinity")
    assert cfg.world_size == 6 and cfg.ffn_world_rank(1) == 5
    # Liveness is short; the rendezvous waits for FFN servers that load their experts first.
    assert (cfg.timeout_seconds, cfg.rendezvous_timeout_seconds) == (60.0, 600.0)


def test_afd_plugin_aliases_and_string_numbers():
    cfg = parse_afd_config({"afd": {"afd_role": "ffn", "afd_connector": "p2pconnector", "afd_host": "afd-attn-0.svc",
                                    "afd_port": "29500", "async_dp": "true", "num_attention_ranks": "2",
                                    "num_ffn_ranks": 1, "afd_extra_config": {"attn_ranks_per_dp": 2},
                                    "shared_experts": {"placement": "ffn", "partition": "contiguous"},
                                    "metrics_port": 9100, "health_port": 9101}})
    assert (cfg.role, cfg.connector, cfg.host, cfg.port) == ("ffn", "p2p", "afd-attn-0.svc", 29500)
    assert cfg.attn_ranks_per_dp == 2 and cfg.shared_experts.partition == "contiguous"
    assert (cfg.metrics_port, cfg.health_port) == (9100, 9101)


@pytest.mark.parametrize("afd,path,rule", [
    ({"bogus": 1}, "afd.bogus", "unknown key"),
    ({"role": "router"}, "afd.role", "must be one of"),
    ({"port": 70000}, "afd.port", "must be in [1, 65535]"),
    ({"port": True}, "afd.port", "must be an integer"),
    ({"num_ffn_ranks": 0}, "afd.num_ffn_ranks", ">= 1"),
    ({"connector": "nixl"}, "afd.connector", "unknown connector"),
    ({"async": "maybe"}, "afd.async", "boolean"),
    ({"host": "two words"}, "afd.host", "IP address or DNS name"),
    ({"connector_extra_config": {"attn_ranks_per_dp": 3}}, "afd.connector_extra_config.attn_ranks_per_dp", "divide"),
    ({"connector_extra_config": {"dynamicQuant": 2}}, "afd.connector_extra_config.dynamicQuant", "[0, 1]"),
    ({"connector_extra_config": {"extra": 1}}, "afd.connector_extra_config.extra", "unknown key"),
    ({"connector_extra_config": {"data_plane": "nccl"}}, "afd.connector_extra_config.data_plane",
     "must be one of auto, direct, staged"),
    ({"shared_experts": {"placement": "gpu"}}, "afd.shared_experts.placement", "must be one of"),
    ({"shared_experts": {"where": "ffn"}}, "afd.shared_experts.where", "unknown key"),
    ({"shared_experts": {"placement": "ffn"}, "async": False}, "afd.shared_experts.placement", "async connector"),
    ({"shared_experts": {"placement": "ffn"}, "compute_gate_on_attention": False}, "afd.shared_experts.placement",
     "compute_gate_on_attention"),
    ({"shared_experts": {"placement": "ffn"}, "connector_extra_config": {"dynamicQuant": 1}},
     "afd.connector_extra_config.dynamicQuant", "not supported"),
    ({"num_stages": 2, "async": False}, "afd.num_stages", "more than 1 stage needs an async connector"),
    ({"num_stages": MAX_STAGES + 1}, "afd.num_stages", f"[1, {MAX_STAGES}]"),
    ({"metrics_port": 1239}, "afd.metrics_port", "must differ from afd.port"),
    ({"timeout_seconds": 0}, "afd.timeout_seconds", "positive"),
    ({"rendezvous_timeout_seconds": -5}, "afd.rendezvous_timeout_seconds", "positive"),
    ({"rendezvous_timeout_seconds": True}, "afd.rendezvous_timeout_seconds", "positive"),
    ({"role": "ffn", "afd_role": "ffn"}, "afd.afd_role", "duplicates"),
    ({"min_split_tokens": {"decode": 0}}, "afd.min_split_tokens.decode", ">= 1"),
    ({"min_split_tokens": {"prefill": "many"}}, "afd.min_split_tokens.prefill", "must be an integer"),
    ({"min_split_tokens": {"mixed": 3}}, "afd.min_split_tokens.mixed", "unknown key"),
])
def test_rejections_name_field_and_rule(afd, path, rule):
    with pytest.raises(AFDConfigError) as info:
        parse(**afd)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ") and rule in str(info.value)


def test_missing_block_and_required_keys():
    with pytest.raises(AFDConfigError, match=r"^afd: missing"):
        parse_afd_config({})
    with pytest.raises(AFDConfigError, match=r"^afd\.num_ffn_ranks: is required"):
        parse_afd_config({"afd": {"role": "ffn", "num_attention_ranks": 1}})


def test_experts_must_divide_over_ffn_ranks():
    cfg = parse(num_ffn_ranks=3)
    with pytest.raises(AFDConfigError, match=r"^afd\.num_ffn_ranks: must divide the model's 8 routed experts"):
        cfg.validate_for_model(8)
    parse(num_ffn_ranks=4).validate_for_model(8)


# ---- one schema: the serializer the operator renders with, and the builder it plans with ----

HOSTS = st.one_of(
    st.from_regex(r"[a-z0-9]([-a-z0-9.]{0,40}[a-z0-9])?", fullmatch=True),
    st.ip_addresses().map(str),
)
PROBE_PORTS = st.one_of(st.none(), st.integers(min_value=0, max_value=65535))


@st.composite
def afd_configs(draw) -> AFDConfig:
    """Any config parse_afd_config can return: every field over its whole accepted range."""
    attn_per_dp = draw(st.integers(min_value=1, max_value=16))
    placement = draw(st.sampled_from(PLACEMENTS))
    ffn_placement = placement == "ffn"  # needs async + gate on Attention, refuses quantized dispatch
    num_stages = draw(st.integers(min_value=1, max_value=MAX_STAGES))  # more than one needs async
    port = draw(st.integers(min_value=1, max_value=65535))
    # A probe port may not be the rendezvous port (0, "pick one", never is).
    metrics_port, health_port = (draw(PROBE_PORTS.filter(lambda p: p != port)) for _ in range(2))
    return AFDConfig(
        role=draw(st.sampled_from(ROLES)),
        num_attention_ranks=attn_per_dp * draw(st.integers(min_value=1, max_value=64)),
        num_ffn_ranks=draw(st.integers(min_value=1, max_value=1024)),
        connector=draw(st.sampled_from(sorted(CONNECTORS))),
        async_dp=True if ffn_placement or num_stages > 1 else draw(st.booleans()),
        host=draw(HOSTS),
        port=port,
        num_stages=num_stages,
        compute_gate_on_attention=True if ffn_placement else draw(st.booleans()),
        attn_ranks_per_dp=attn_per_dp,
        dynamic_quant=0 if ffn_placement else draw(st.integers(min_value=0, max_value=1)),
        data_plane=draw(st.sampled_from(DATA_PLANES)),
        shared_experts=SharedExpertsConfig(placement=placement, partition=draw(st.sampled_from(PARTITIONS))),
        min_split_tokens=MinSplitTokens(decode=draw(st.integers(1, 1 << 20)), prefill=draw(st.integers(1, 1 << 20))),
        metrics_port=metrics_port,
        health_port=health_port,
        timeout_seconds=draw(st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)),
        rendezvous_timeout_seconds=draw(st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)),
    )


@given(afd_configs())
def test_block_round_trips_through_the_parser(cfg):
    assert parse_afd_config(cfg.as_additional_config()) == cfg
    # What a pod reads: the block as JSON on its command line.
    assert parse_afd_config(json.loads(json.dumps(cfg.as_additional_config()))) == cfg


@given(afd_configs())
def test_block_spells_every_key_canonically(cfg):
    block = cfg.to_block()
    assert set(block) <= set(TOP_LEVEL_KEYS) and set(block["connector_extra_config"]) == set(EXTRA_KEYS)
    assert set(block["shared_experts"]) == set(SHARED_KEYS)


def test_build_normalizes_what_users_write_and_lays_extra_config_over_typed_fields():
    cfg = AFDConfig.build(role="ffn", num_attention_ranks=4, num_ffn_ranks=2, attn_ranks_per_dp=2,
                          connector="P2PConnector", connector_extra_config={"dynamicQuant": "1"})
    assert (cfg.connector, cfg.attn_ranks_per_dp, cfg.dynamic_quant) == ("p2p", 2, 1)
    assert AFDConfig.build(role="ffn", num_attention_ranks=4, num_ffn_ranks=2, attn_ranks_per_dp=2,
                           connector_extra_config={"attn_ranks_per_dp": 4}).attn_ranks_per_dp == 4


@pytest.mark.parametrize("raw,path,rule", [
    ({"connector": "nixl"}, "afd.connector", "unknown connector"),
    ({"connector": 7}, "afd.connector", "must be a string"),
    ({"connector_extra_config": {"foo": 1}}, "afd.connector_extra_config.foo", "unknown key"),
    ({"connector_extra_config": {"dynamicQuant": "yes"}}, "afd.connector_extra_config.dynamicQuant", "integer"),
    ({"connector_extra_config": {"attn_ranks_per_dp": 3}}, "afd.connector_extra_config.attn_ranks_per_dp",
     "must divide afd.num_attention_ranks"),
])
def test_build_refuses_what_the_parser_refuses(raw, path, rule):
    with pytest.raises(AFDConfigError) as info:
        AFDConfig.build(role="attention", num_attention_ranks=4, num_ffn_ranks=2, **raw)
    assert info.value.path == path and rule in str(info.value)


@pytest.mark.parametrize("settings, reason", [
    (dict(platform="ascend"), "CPU model runner only in this version (platform ascend: untested)"),
    (dict(platform="cpu", worker_cls="my.Worker"), "--worker-cls my.Worker was given"),
    (dict(platform="cpu", speculative=True), "speculative decoding"),
    (dict(platform="cpu", pipeline_parallel=2), "pipeline parallel"),
    (dict(platform="cpu", vllm_micro_batching=True), "--enable-dbo"),
])
def test_stage_limit_says_why_a_world_runs_one_stage(settings, reason):
    limit, why = stage_limit(**settings)
    assert limit == 1 and reason in why


def test_stage_limit_allows_every_stage_count_on_cpu():
    assert stage_limit(platform="cpu") == (MAX_STAGES, "")


def test_every_config_attribute_has_exactly_one_block_field():
    """AFDConfig, its builder, ``to_block`` and the parser follow config.FIELDS: an attribute
    added to the dataclass without a field there (or the other way round) fails here."""
    attributes = {f.name for f in dataclasses.fields(AFDConfig) if f.name not in NESTED}
    attributes |= {f"{name}.{f.name}" for name, kind in NESTED.items() for f in dataclasses.fields(kind)}
    table = [block_field.attr for block_field in FIELDS]
    assert sorted(table) == sorted(attributes) and len(set(table)) == len(table)
    paths = [block_field.path for block_field in FIELDS]
    assert len(set(paths)) == len(paths)
    # Every field's default is what the dataclass holds when the block leaves the key out.
    parsed = parse()
    for block_field in FIELDS:
        if block_field.default is not REQUIRED:
            assert parsed.value(block_field) == block_field.default, block_field.path


def test_the_vllm_glue_parses_an_engine_configs_block_once(monkeypatch):
    """Every hook and every MoE layer asks for the block of the same engine config: one parse."""
    from afd_shared_experts.vllm import compat

    parses = []
    monkeypatch.setattr(compat, "require_supported_vllm", lambda: None)
    monkeypatch.setattr(compat, "parse_afd_config", lambda additional: parses.append(1) or parse_afd_config(additional))
    engine = type("VllmConfig", (), {"additional_config": {"afd": {**BASE}}})()
    configs = [compat.afd_config_of(engine) for _ in range(60)]
    assert len(parses) == 1 and all(cfg is configs[0] for cfg in configs)
    other = type("VllmConfig", (), {"additional_config": {"afd": {**BASE, "num_ffn_ranks": 4}}})()
    assert compat.afd_config_of(other).num_ffn_ranks == 4 and len(parses) == 2
    assert compat.afd_config_of(type("VllmConfig", (), {"additional_config": {}})()) is None
