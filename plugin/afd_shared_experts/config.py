"""Strict parsing of the ``afd`` block of vLLM's ``--additional-config``.

Keys follow the afd-plugin spellings; the older ``afd_*`` spellings used by vLLM's AFD
prototype are accepted as aliases. Every error names the field path and the rule broken.
``AFDConfig.to_block`` writes the block back (canonical spellings, every key), which is how
the operator renders each pod's block: one schema for both sides. Torch-free: the operator
imports this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

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

# How payloads travel (docs/plugin-runtime.md): on the device backend, staged through host memory
# over gloo, or whichever every rank of the world can use (the same on every rank).
DATA_PLANES = ("auto", "direct", "staged")


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


# Starts the one log line an AFD engine writes when it refuses its config or checkpoint (vLLM
# reports the refusal after a traceback); the operator quotes that line in its events.
REFUSAL_MARKER = "afd: refused:"


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


# Below these step sizes a step runs as one stage whatever num_stages says: each micro-batch
# costs both sides a fixed amount (launches, messages, a pass over the expert weights), which a
# small step cannot win back. Measured with vllm serve (docs/benchmarks.md, "Where stages pay"):
# every step split paid at 64 requests (64-token decodes, 2048-token prefills) and not at 16 or 32.
DEFAULT_MIN_SPLIT_DECODE_TOKENS = 64
DEFAULT_MIN_SPLIT_PREFILL_TOKENS = 1024


@dataclass(frozen=True)
class MinSplitTokens:
    """The fewest tokens a step needs before it is split into micro-batch stages: ``decode``
    for steps whose every request schedules one token, ``prefill`` for the others."""

    decode: int = DEFAULT_MIN_SPLIT_DECODE_TOKENS
    prefill: int = DEFAULT_MIN_SPLIT_PREFILL_TOKENS


# --------------------------------------------------------------------------- field parsers
# Each takes (raw value, field path) and returns the typed value or raises AFDConfigError.


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


def _integer(minimum: int, maximum: int | None = None) -> Callable[[Any, str], int]:
    return lambda value, path: _as_int(value, path, minimum=minimum, maximum=maximum)


def _boolean(value: Any, path: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise AFDConfigError(path, "must be a boolean (true|false)", value)


def _choice(choices: tuple[str, ...]) -> Callable[[Any, str], str]:
    def parse(value: Any, path: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise AFDConfigError(path, f"must be one of {', '.join(choices)}", value)
        return value

    return parse


def _optional_port(value: Any, path: str) -> int | None:
    return None if value is None else _as_int(value, path, minimum=0, maximum=65535)


def _positive_seconds(value: Any, path: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise AFDConfigError(path, "must be a positive number of seconds", value)
    return float(value)


def _connector_name(value: Any, path: str) -> str:
    if not isinstance(value, str):
        raise AFDConfigError(path, "must be a string", value)
    connector = CONNECTOR_ALIASES.get(value.lower(), value.lower())
    if connector not in CONNECTORS:
        known = ", ".join(sorted(CONNECTORS) + sorted(CONNECTOR_ALIASES))
        raise AFDConfigError(path, f"unknown connector; known: {known}", value)
    return connector


def _host(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value or any(c.isspace() for c in value):
        raise AFDConfigError(path, "must be a non-empty IP address or DNS name", value)
    return value


# --------------------------------------------------------------------------- the fields

REQUIRED = object()


@dataclass(frozen=True)
class BlockField:
    """One key of the ``afd`` block: where it sits (``section`` None: top level), the
    ``AFDConfig`` attribute it fills (dotted for ``shared_experts``), its parser, default and
    older spellings."""

    key: str
    attr: str
    parse: Callable[[Any, str], Any]
    default: Any = REQUIRED
    section: str | None = None
    aliases: tuple[str, ...] = ()

    @property
    def path(self) -> str:
        return ".".join(["afd", *([self.section] if self.section else []), self.key])


# The one table of the block: AFDConfig, its builder, ``to_block`` and the parser all follow it.
FIELDS = (
    BlockField("role", "role", _choice(ROLES), aliases=("afd_role",)),
    BlockField("connector", "connector", _connector_name, "p2p", aliases=("afd_connector",)),
    BlockField("async", "async_dp", _boolean, True, aliases=("async_dp",)),
    BlockField("host", "host", _host, "127.0.0.1", aliases=("afd_host",)),
    BlockField("port", "port", _integer(1, 65535), DEFAULT_RENDEZVOUS_PORT, aliases=("afd_port",)),
    BlockField("num_attention_ranks", "num_attention_ranks", _integer(1)),
    BlockField("num_ffn_ranks", "num_ffn_ranks", _integer(1)),
    BlockField("num_stages", "num_stages", _integer(1, MAX_STAGES), 1, aliases=("num_afd_stages",)),
    BlockField("compute_gate_on_attention", "compute_gate_on_attention", _boolean, True),
    BlockField("attn_ranks_per_dp", "attn_ranks_per_dp", _integer(1), 1, section="connector_extra_config"),
    BlockField("dynamicQuant", "dynamic_quant", _integer(0, 1), 0, section="connector_extra_config"),
    BlockField("data_plane", "data_plane", _choice(DATA_PLANES), "auto", section="connector_extra_config"),
    BlockField("placement", "shared_experts.placement", _choice(PLACEMENTS), "attention", section="shared_experts"),
    BlockField("partition", "shared_experts.partition", _choice(PARTITIONS), "affinity", section="shared_experts"),
    BlockField("decode", "min_split_tokens.decode", _integer(1), DEFAULT_MIN_SPLIT_DECODE_TOKENS,
               section="min_split_tokens"),
    BlockField("prefill", "min_split_tokens.prefill", _integer(1), DEFAULT_MIN_SPLIT_PREFILL_TOKENS,
               section="min_split_tokens"),
    BlockField("metrics_port", "metrics_port", _optional_port, None),
    BlockField("health_port", "health_port", _optional_port, None),
    BlockField("timeout_seconds", "timeout_seconds", _positive_seconds, DEFAULT_TIMEOUT_SECONDS),
    BlockField("rendezvous_timeout_seconds", "rendezvous_timeout_seconds", _positive_seconds,
               DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS),
)
SECTIONS = {"connector_extra_config": ("afd_extra_config",), "shared_experts": (), "min_split_tokens": ()}
# AFDConfig attributes that hold a section's fields as a dataclass of their own.
NESTED = {"shared_experts": SharedExpertsConfig, "min_split_tokens": MinSplitTokens}
TOP_LEVEL_KEYS = tuple(dict.fromkeys([f.key for f in FIELDS if f.section is None] + list(SECTIONS)))
KEY_ALIASES = {alias: f.key for f in FIELDS if f.section is None for alias in f.aliases} | \
    {alias: section for section, aliases in SECTIONS.items() for alias in aliases}
EXTRA_KEYS = tuple(f.key for f in FIELDS if f.section == "connector_extra_config")
SHARED_KEYS = tuple(f.key for f in FIELDS if f.section == "shared_experts")


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
    min_split_tokens: MinSplitTokens = field(default_factory=MinSplitTokens)
    metrics_port: int | None = None
    health_port: int | None = None
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    rendezvous_timeout_seconds: float = DEFAULT_RENDEZVOUS_TIMEOUT_SECONDS

    @property
    def world_size(self) -> int:
        return self.num_attention_ranks + self.num_ffn_ranks

    def ffn_world_rank(self, ffn_index: int) -> int:
        return self.num_attention_ranks + ffn_index

    def value(self, block_field: BlockField) -> Any:
        owner, _, attr = block_field.attr.rpartition(".")
        return getattr(getattr(self, owner) if owner else self, attr)

    def to_block(self) -> dict[str, Any]:
        """The ``afd`` block in canonical key spellings, every key (unset probe ports are left
        out: the parser reads an absent key as None): ``parse_afd_config`` of
        :meth:`as_additional_config` gives back an equal config (JSON-safe values only)."""
        block: dict[str, Any] = {}
        for block_field in FIELDS:
            value = self.value(block_field)
            if value is None:
                continue
            (block.setdefault(block_field.section, {}) if block_field.section else block)[block_field.key] = value
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


def _check_keys(block: Mapping[str, Any], allowed: tuple[str, ...], path: str,
                aliases: Mapping[str, str] | None = None) -> dict[str, Any]:
    if not isinstance(block, Mapping):
        raise AFDConfigError(path, "must be a mapping", block)
    normalized: dict[str, Any] = {}
    for key, value in block.items():
        canonical = (aliases or {}).get(key, key)
        if canonical not in allowed:
            raise AFDConfigError(f"{path}.{key}", f"unknown key; allowed: {', '.join(allowed)}", value)
        if canonical in normalized:
            raise AFDConfigError(f"{path}.{key}", f"duplicates {canonical!r} (alias and canonical spelling both set)", value)
        normalized[canonical] = value
    return normalized


def _parse_fields(additional_config: Mapping[str, Any]) -> dict[str, Any]:
    """Every field of the table from the block: attribute -> typed value."""
    if not isinstance(additional_config, Mapping) or "afd" not in additional_config:
        raise AFDConfigError("afd", "missing: the additional config has no 'afd' block", show_value=False)
    raw = _check_keys(additional_config["afd"], TOP_LEVEL_KEYS, "afd", KEY_ALIASES)
    sections = {section: _check_keys(raw.get(section, {}), tuple(f.key for f in FIELDS if f.section == section),
                                     f"afd.{section}")
                for section in SECTIONS}
    values = {}
    for block_field in FIELDS:
        holder = sections[block_field.section] if block_field.section else raw
        if block_field.key in holder:
            values[block_field.attr] = block_field.parse(holder[block_field.key], block_field.path)
        elif block_field.default is REQUIRED:
            raise AFDConfigError(block_field.path, "is required", show_value=False)
        else:
            values[block_field.attr] = block_field.default
    return values


def parse_afd_config(additional_config: Mapping[str, Any]) -> AFDConfig:
    """Parse vLLM's ``additional_config`` mapping (which must hold an ``afd`` block)."""
    values = _parse_fields(additional_config)
    nested = {name: kind(**{attr.split(".", 1)[1]: values.pop(attr) for attr in list(values)
                            if attr.startswith(f"{name}.")})
              for name, kind in NESTED.items()}
    cfg = AFDConfig(**nested, **values)
    _check_rules(cfg)
    return cfg


def _check_rules(cfg: AFDConfig) -> None:
    """Rules between fields."""
    if cfg.num_attention_ranks % cfg.attn_ranks_per_dp != 0:
        raise AFDConfigError("afd.connector_extra_config.attn_ranks_per_dp",
                             f"must divide afd.num_attention_ranks ({cfg.num_attention_ranks} = DP x TP)",
                             cfg.attn_ranks_per_dp)
    async_connector = cfg.async_dp and CONNECTORS[cfg.connector]
    if cfg.shared_experts.placement == "ffn":
        # FFN-side shared experts ride in the dispatch header: needs the async, header-driven path.
        if not async_connector:
            raise AFDConfigError("afd.shared_experts.placement", "'ffn' requires an async connector (afd.async: true)",
                                 "ffn")
        # Both partitions are derived from the top-k ids, so the gate must run on Attention.
        if not cfg.compute_gate_on_attention:
            raise AFDConfigError("afd.shared_experts.placement", "'ffn' requires afd.compute_gate_on_attention: true",
                                 "ffn")
    if cfg.num_stages > 1 and not async_connector:
        # Micro-batches of a step are dispatched before the first is combined: the FFN side
        # must serve work in arrival order, as the async, header-driven path does.
        raise AFDConfigError("afd.num_stages", "more than 1 stage needs an async connector (afd.async: true)",
                             cfg.num_stages)
    if cfg.dynamic_quant and cfg.shared_experts.placement == "ffn":
        raise AFDConfigError("afd.connector_extra_config.dynamicQuant",
                             "quantized dispatch is not supported with shared_experts.placement 'ffn'", cfg.dynamic_quant)
    for name, value in (("metrics_port", cfg.metrics_port), ("health_port", cfg.health_port)):
        if value is not None and value != 0 and value == cfg.port:
            raise AFDConfigError(f"afd.{name}", "must differ from afd.port (the rendezvous port)", value)
