"""Strict parsing of the ``afd`` block of vLLM's ``--additional-config``.

Keys follow the afd-plugin spellings; the older ``afd_*`` spellings used by vLLM's AFD
prototype are accepted as aliases. Every error names the field path and the rule broken.
``AFDConfig.to_block`` writes the block back (canonical spellings, every key), which is how
the operator renders each pod's block: one schema for both sides. Torch-free: the operator
imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

DEFAULT_RENDEZVOUS_PORT = 1239
DEFAULT_TIMEOUT_SECONDS = 60.0
# How long rank 0 waits for every rank of its world to join: FFN servers load their experts
# before they join, which for a large checkpoint takes minutes. vLLM's own bound on an engine
# coming up (VLLM_ENGINE_READY_TIMEOUT_S) defaults to the same 600 s.
DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS = 600.0

ROLES = ("attention", "ffn")
PLACEMENTS = ("attention", "ffn")
PARTITIONS = ("affinity", "contiguous")

# Connector name -> whether it serves work items asynchronously (header-driven, arrival order).
CONNECTORS = {"p2p": True}
CONNECTOR_ALIASES = {"p2pconnector": "p2p", "torch_p2p": "p2p"}

KEY_ALIASES = {
    "afd_role": "role",
    "afd_connector": "connector",
    "async_dp": "async",
    "afd_host": "host",
    "afd_port": "port",
    "num_afd_stages": "num_stages",
    "afd_extra_config": "connector_extra_config",
}
TOP_LEVEL_KEYS = (
    "role",
    "connector",
    "async",
    "host",
    "port",
    "num_attention_ranks",
    "num_ffn_ranks",
    "num_stages",
    "compute_gate_on_attention",
    "connector_extra_config",
    "shared_experts",
    "metrics_port",
    "health_port",
    "timeout_seconds",
    "rendezvous_timeout_seconds",
)
EXTRA_KEYS = ("attn_ranks_per_dp", "dynamicQuant", "data_plane")
# How payloads travel (docs/plugin-runtime.md): on the device backend, staged through host memory
# over gloo, or whichever every rank of the world can use (the same on every rank).
DATA_PLANES = ("auto", "direct", "staged")
SHARED_KEYS = ("placement", "partition")


# The most micro-batch stages an Attention step runs; the wire format and the FFN side apply the same bound.
MAX_STAGES = 8


def stage_limit(*, platform: str, worker_cls: str | None = None, speculative: bool = False,
                pipeline_parallel: int = 1, vllm_micro_batching: bool = False) -> tuple[int, str]:
    """The most micro-batch stages an Attention engine with these settings may run, and why
    not more (empty when the limit is ``MAX_STAGES``). One rule for the operator (from a spec)
    and the vLLM glue (from an engine config)."""
    if platform != "cpu":
        return 1, (f"micro-batch stages run on vLLM's CPU model runner only in this version (platform {platform}: "
                   "untested)")
    if worker_cls is not None:
        return 1, f"micro-batch stages need the plugin's worker; --worker-cls {worker_cls} was given"
    if speculative:
        return 1, "speculative decoding is not supported with micro-batch stages"
    if pipeline_parallel > 1:
        return 1, f"pipeline parallel is not supported with micro-batch stages (size {pipeline_parallel})"
    if vllm_micro_batching:
        return 1, "vLLM's own micro-batching (--enable-dbo / --ubatch-size) is not combined with these stages"
    return MAX_STAGES, ""


class AFDConfigError(ValueError):
    """Invalid ``afd`` configuration; the message starts with the field path."""

    def __init__(self, path: str, rule: str, value: Any = None, *, show_value: bool = True):
        self.path = path
        self.rule = rule
        suffix = f" (got {value!r})" if show_value else ""
        super().__init__(f"{path}: {rule}{suffix}")


@dataclass(frozen=True)
class SharedExpertsConfig:
    # "attention" keeps the pre-existing behaviour; "ffn" is the opt-in new placement.
    placement: str = "attention"
    partition: str = "affinity"

    def to_block(self) -> dict[str, Any]:
        return {"placement": self.placement, "partition": self.partition}


@dataclass(frozen=True)
class AFDConfig:
    role: str
    num_attention_ranks: int
    num_ffn_ranks: int
    connector: str = "p2p"
    async_dp: bool = True
    host: str = "127.0.0.1"
    port: int = DEFAULT_RENDEZVOUS_PORT
    num_stages: int = 1
    compute_gate_on_attention: bool = True
    attn_ranks_per_dp: int = 1
    dynamic_quant: int = 0
    data_plane: str = "auto"
    shared_experts: SharedExpertsConfig = field(default_factory=SharedExpertsConfig)
    metrics_port: int | None = None
    health_port: int | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    rendezvous_timeout_seconds: float = DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    def ffn_world_rank(self, ffn_index: int) -> int:
        return self.num_attention_ranks + ffn_index

    def to_block(self) -> dict[str, Any]:
        """The ``afd`` block in canonical key spellings: ``parse_afd_config`` of
        :meth:`as_additional_config` gives back an equal config (JSON-safe values only)."""
        block: dict[str, Any] = {
            "role": self.role,
            "connector": self.connector,
            "async": self.async_dp,
            "host": self.host,
            "port": self.port,
            "num_attention_ranks": self.num_attention_ranks,
            "num_ffn_ranks": self.num_ffn_ranks,
            "num_stages": self.num_stages,
            "compute_gate_on_attention": self.compute_gate_on_attention,
            "connector_extra_config": {
                "attn_ranks_per_dp": self.attn_ranks_per_dp,
                "dynamicQuant": self.dynamic_quant,
                "data_plane": self.data_plane,
            },
            "shared_experts": self.shared_experts.to_block(),
            "timeout_seconds": self.timeout_seconds,
            "rendezvous_timeout_seconds": self.rendezvous_timeout_seconds,
        }
        # Unset probe ports are left out: the parser reads an absent key as None.
        for key, port in (("metrics_port", self.metrics_port), ("health_port", self.health_port)):
            if port is not None:
                block[key] = port
        return block

    def as_additional_config(self) -> dict[str, Any]:
        """vLLM's ``--additional-config`` mapping that carries this config."""
        return {"afd": self.to_block()}

    @classmethod
    def build(cls, *, connector: Any = "p2p", connector_extra_config: Mapping[str, Any] | None = None,
              **fields: Any) -> AFDConfig:
        """A config from typed field values plus the two parts a user writes by hand: the
        connector name (any spelling the parser accepts) and ``connector_extra_config``
        entries, laid over the typed ones. It goes through :func:`parse_afd_config`, so
        every rule a pod applies applies here, and a refusal (:class:`AFDConfigError`)
        names the block path, e.g. ``afd.connector_extra_config.<key>``."""
        block = cls(**fields).to_block()
        block["connector"] = connector
        block["connector_extra_config"] = {**block["connector_extra_config"], **(connector_extra_config or {})}
        return parse_afd_config({"afd": block})

    def validate_for_model(self, num_routed_experts: int, *, field_path: str = "afd.num_ffn_ranks") -> None:
        """Rules that need the model: expert-parallel split must be even."""
        if num_routed_experts % self.num_ffn_ranks != 0:
            raise AFDConfigError(
                field_path,
                f"must divide the model's {num_routed_experts} routed experts evenly",
                self.num_ffn_ranks,
            )


def _check_keys(block: Mapping[str, Any], allowed: tuple[str, ...], path: str) -> dict[str, Any]:
    if not isinstance(block, Mapping):
        raise AFDConfigError(path, "must be a mapping", block)
    normalized: dict[str, Any] = {}
    for key, value in block.items():
        canonical = KEY_ALIASES.get(key, key) if path == "afd" else key
        if canonical not in allowed:
            raise AFDConfigError(f"{path}.{key}", f"unknown key; allowed: {', '.join(allowed)}", value)
        if canonical in normalized:
            raise AFDConfigError(f"{path}.{key}", f"duplicates {canonical!r} (alias and canonical spelling both set)", value)
        normalized[canonical] = value
    return normalized


def _as_int(value: Any, path: str, *, minimum: int, maximum: int | None = None) -> int:
    # afd-plugin examples pass numbers as JSON strings ("29500"); accept decimal strings too.
    if isinstance(value, bool):
        raise AFDConfigError(path, "must be an integer", value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        parsed = int(value.strip())
    elif isinstance(value, int):
        parsed = value
    else:
        raise AFDConfigError(path, "must be an integer", value)
    if parsed < minimum or (maximum is not None and parsed > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise AFDConfigError(path, f"must be {bound}", value)
    return parsed


def _as_bool(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise AFDConfigError(path, "must be a boolean (true|false)", value)


def _as_choice(value: Any, path: str, choices: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise AFDConfigError(path, f"must be one of {', '.join(choices)}", value)
    return value


def _as_port(value: Any, path: str) -> int:
    return _as_int(value, path, minimum=0, maximum=65535)


def _positive_seconds(raw: Mapping[str, Any], key: str, default: float) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise AFDConfigError(f"afd.{key}", "must be a positive number of seconds", value)
    return float(value)


def parse_afd_config(additional_config: Mapping[str, Any]) -> AFDConfig:
    """Parse vLLM's ``additional_config`` mapping (which must hold an ``afd`` block)."""
    if not isinstance(additional_config, Mapping) or "afd" not in additional_config:
        raise AFDConfigError("afd", "missing: the additional config has no 'afd' block", show_value=False)
    raw = _check_keys(additional_config["afd"], TOP_LEVEL_KEYS, "afd")

    for required in ("role", "num_attention_ranks", "num_ffn_ranks"):
        if required not in raw:
            raise AFDConfigError(f"afd.{required}", "is required", show_value=False)
    role = _as_choice(raw["role"], "afd.role", ROLES)
    num_attention = _as_int(raw["num_attention_ranks"], "afd.num_attention_ranks", minimum=1)
    num_ffn = _as_int(raw["num_ffn_ranks"], "afd.num_ffn_ranks", minimum=1)

    connector_name = raw.get("connector", "p2p")
    if not isinstance(connector_name, str):
        raise AFDConfigError("afd.connector", "must be a string", connector_name)
    connector = CONNECTOR_ALIASES.get(connector_name.lower(), connector_name.lower())
    if connector not in CONNECTORS:
        known = ", ".join(sorted(CONNECTORS) + sorted(CONNECTOR_ALIASES))
        raise AFDConfigError("afd.connector", f"unknown connector; known: {known}", connector_name)
    async_dp = _as_bool(raw.get("async", True), "afd.async")

    host = raw.get("host", "127.0.0.1")
    if not isinstance(host, str) or not host.strip() or any(c.isspace() for c in host):
        raise AFDConfigError("afd.host", "must be a non-empty IP address or DNS name", host)
    port = _as_int(raw.get("port", DEFAULT_RENDEZVOUS_PORT), "afd.port", minimum=1, maximum=65535)
    num_stages = _as_int(raw.get("num_stages", 1), "afd.num_stages", minimum=1, maximum=MAX_STAGES)
    gate_on_attention = _as_bool(raw.get("compute_gate_on_attention", True), "afd.compute_gate_on_attention")

    extra = _check_keys(raw.get("connector_extra_config", {}), EXTRA_KEYS, "afd.connector_extra_config")
    attn_per_dp = _as_int(extra.get("attn_ranks_per_dp", 1), "afd.connector_extra_config.attn_ranks_per_dp", minimum=1)
    if num_attention % attn_per_dp != 0:
        raise AFDConfigError(
            "afd.connector_extra_config.attn_ranks_per_dp",
            f"must divide afd.num_attention_ranks ({num_attention} = DP x TP)",
            attn_per_dp,
        )
    dynamic_quant = _as_int(extra.get("dynamicQuant", 0), "afd.connector_extra_config.dynamicQuant", minimum=0, maximum=1)
    data_plane = _as_choice(extra.get("data_plane", "auto"), "afd.connector_extra_config.data_plane", DATA_PLANES)

    shared_raw = _check_keys(raw.get("shared_experts", {}), SHARED_KEYS, "afd.shared_experts")
    shared = SharedExpertsConfig(
        placement=_as_choice(shared_raw.get("placement", "attention"), "afd.shared_experts.placement", PLACEMENTS),
        partition=_as_choice(shared_raw.get("partition", "affinity"), "afd.shared_experts.partition", PARTITIONS),
    )
    if shared.placement == "ffn":
        # FFN-side shared experts ride in the dispatch header: needs the async, header-driven path.
        if not async_dp or not CONNECTORS[connector]:
            raise AFDConfigError(
                "afd.shared_experts.placement",
                "'ffn' requires an async connector (afd.async: true)",
                shared.placement,
            )
        # Both partitions are derived from the top-k ids, so the gate must run on Attention.
        if not gate_on_attention:
            raise AFDConfigError(
                "afd.shared_experts.placement",
                "'ffn' requires afd.compute_gate_on_attention: true",
                shared.placement,
            )
    if num_stages > 1 and not (async_dp and CONNECTORS[connector]):
        # Micro-batches of a step are dispatched before the first is combined: the FFN side
        # must serve work in arrival order, as the async, header-driven path does.
        raise AFDConfigError("afd.num_stages", "more than 1 stage needs an async connector (afd.async: true)",
                             num_stages)
    if dynamic_quant and shared.placement == "ffn":
        raise AFDConfigError(
            "afd.connector_extra_config.dynamicQuant",
            "quantized dispatch is not supported with shared_experts.placement 'ffn'",
            dynamic_quant,
        )

    metrics_port = None if raw.get("metrics_port") is None else _as_port(raw["metrics_port"], "afd.metrics_port")
    health_port = None if raw.get("health_port") is None else _as_port(raw["health_port"], "afd.health_port")
    for name, value in (("metrics_port", metrics_port), ("health_port", health_port)):
        if value is not None and value != 0 and value == port:
            raise AFDConfigError(f"afd.{name}", "must differ from afd.port (the rendezvous port)", value)

    timeout = _positive_seconds(raw, "timeout_seconds", DEFAULT_TIMEOUT_SECONDS)
    rendezvous_timeout = _positive_seconds(raw, "rendezvous_timeout_seconds", DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS)

    return AFDConfig(
        role=role,
        num_attention_ranks=num_attention,
        num_ffn_ranks=num_ffn,
        connector=connector,
        async_dp=async_dp,
        host=host.strip(),
        port=port,
        num_stages=num_stages,
        compute_gate_on_attention=gate_on_attention,
        attn_ranks_per_dp=attn_per_dp,
        dynamic_quant=dynamic_quant,
        data_plane=data_plane,
        shared_experts=shared,
        metrics_port=metrics_port,
        health_port=health_port,
        timeout_seconds=timeout,
        rendezvous_timeout_seconds=rendezvous_timeout,
    )
