import pytest

from afd_shared_experts.config import AFDConfigError, parse_afd_config

BASE = {"role": "attention", "num_attention_ranks": 4, "num_ffn_ranks": 2}


def parse(**afd):
    return parse_afd_config({"afd": {**BASE, **afd}})


def test_defaults_and_types():
    cfg = parse()
    assert (cfg.connector, cfg.async_dp, cfg.port, cfg.host) == ("p2p", True, 1239, "127.0.0.1")
    assert (cfg.shared_experts.placement, cfg.shared_experts.partition) == ("attention", "affinity")
    assert cfg.world_size == 6 and cfg.ffn_world_rank(1) == 5


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
    ({"shared_experts": {"placement": "gpu"}}, "afd.shared_experts.placement", "must be one of"),
    ({"shared_experts": {"where": "ffn"}}, "afd.shared_experts.where", "unknown key"),
    ({"shared_experts": {"placement": "ffn"}, "async": False}, "afd.shared_experts.placement", "async connector"),
    ({"shared_experts": {"placement": "ffn"}, "compute_gate_on_attention": False}, "afd.shared_experts.placement",
     "compute_gate_on_attention"),
    ({"shared_experts": {"placement": "ffn"}, "connector_extra_config": {"dynamicQuant": 1}},
     "afd.connector_extra_config.dynamicQuant", "not supported"),
    ({"metrics_port": 1239}, "afd.metrics_port", "must differ from afd.port"),
    ({"timeout_seconds": 0}, "afd.timeout_seconds", "positive"),
    ({"role": "ffn", "afd_role": "ffn"}, "afd.afd_role", "duplicates"),
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
