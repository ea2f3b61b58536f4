"""The pieces of core/v1 an AFDDeployment passes through to its pods, as typed models with the
API server's own rules (kube_rules): what the operator renders from them is accepted as written,
and a field the API server would drop or refuse is refused here, with its path.

Only the parts an AFD pod needs are modelled (volume sources: emptyDir, hostPath,
persistentVolumeClaim, configMap, secret); everything else is an unknown field.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, model_validator
from pydantic.alias_generators import to_camel, to_snake

from . import kube_rules

# Bounds on the sizes of lists and maps (the CRD says them too): work and objects stay small.
MAX_LIST_ITEMS = 64
MAX_MAP_ENTRIES = 64
MAX_STRING = 4096


class Strict(BaseModel):
    """Base for every API object: camelCase names only (as the API server reads them), exact
    JSON types (no "2" for 2, no 1 for true), unknown fields rejected."""

    model_config = ConfigDict(
        extra="forbid",
        alias_generator=to_camel,
        populate_by_name=False,
        validate_default=True,
        strict=True,
    )


def exactly_one(model: BaseModel, fields: tuple[str, ...]) -> None:
    """Refuse `model` unless exactly one of `fields` (camelCase) is set."""
    given = sum(getattr(model, to_snake(name)) is not None for name in fields)
    if given != 1:
        raise ValueError(f"set exactly one of {', '.join(fields)} (got {given})")


def wire(model: BaseModel) -> dict[str, Any]:
    """A typed piece as the API server reads it: camelCase, only what was set."""
    return model.model_dump(by_alias=True, exclude_defaults=True)


def follows(check: Callable[[str], Optional[str]]) -> AfterValidator:
    """A pydantic validator from a kube_rules check."""

    def validate(value: str) -> str:
        problem = check(value)
        if problem:
            raise ValueError(problem)
        return value

    return AfterValidator(validate)


def _quantity(value: Any) -> Any:
    problem = kube_rules.quantity(value)
    if problem:
        raise ValueError(problem)
    return value


DNSLabel = Annotated[str, follows(kube_rules.dns_label)]
DNSSubdomain = Annotated[str, follows(kube_rules.dns_subdomain)]
QualifiedName = Annotated[str, follows(kube_rules.qualified_name)]
LabelValue = Annotated[str, follows(kube_rules.label_value)]
AbsolutePath = Annotated[str, Field(max_length=MAX_STRING), follows(kube_rules.absolute_path)]
RelativePath = Annotated[str, Field(max_length=MAX_STRING), follows(kube_rules.relative_path)]
ConfigKey = Annotated[str, follows(kube_rules.config_key)]
# A quantity: a string ("500m", "4Gi") or an integer, as the API server's int-or-string takes it.
Quantity = Annotated[Any, BeforeValidator(_quantity),
                     WithJsonSchema({"x-kubernetes-int-or-string": True,
                                     "description": "A Kubernetes quantity, e.g. 500m, 2, 4Gi."})]
Labels = Annotated[dict[QualifiedName, LabelValue], Field(max_length=MAX_MAP_ENTRIES)]
FileMode = Annotated[int, Field(ge=0, le=0o777)]


def _items(model: Any) -> Any:
    return Annotated[list[model], Field(max_length=MAX_LIST_ITEMS)]


# -- selectors -------------------------------------------------------------------------------
class LabelSelectorRequirement(Strict):
    key: QualifiedName
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: _items(LabelValue) = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> "LabelSelectorRequirement":
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"values must not be empty with operator {self.operator}")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"values must be empty with operator {self.operator}")
        return self


class LabelSelector(Strict):
    match_labels: Labels = Field(default_factory=dict)
    match_expressions: _items(LabelSelectorRequirement) = Field(default_factory=list)


class NodeSelectorRequirement(Strict):
    key: QualifiedName
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: _items(Annotated[str, Field(max_length=kube_rules.LABEL_VALUE_MAX)]) = Field(default_factory=list)

    @model_validator(mode="after")
    def _values_match_operator(self) -> "NodeSelectorRequirement":
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"values must not be empty with operator {self.operator}")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"values must be empty with operator {self.operator}")
        if self.operator in ("Gt", "Lt") and (len(self.values) != 1 or not self.values[0].isdigit()):
            raise ValueError(f"values must be one integer with operator {self.operator}")
        for value in self.values:
            problem = kube_rules.label_value(value)
            if problem:
                raise ValueError(f"values: '{value}' {problem}")
        return self


class NodeSelectorFieldRequirement(Strict):
    key: Literal["metadata.name"]
    operator: Literal["In", "NotIn"]
    values: Annotated[list[DNSSubdomain], Field(min_length=1, max_length=1)]


class NodeSelectorTerm(Strict):
    match_expressions: _items(NodeSelectorRequirement) = Field(default_factory=list)
    match_fields: _items(NodeSelectorFieldRequirement) = Field(default_factory=list)


class NodeSelector(Strict):
    node_selector_terms: Annotated[list[NodeSelectorTerm], Field(min_length=1, max_length=MAX_LIST_ITEMS)]


class PreferredSchedulingTerm(Strict):
    weight: int = Field(ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(Strict):
    required_during_scheduling_ignored_during_execution: Optional[NodeSelector] = None
    preferred_during_scheduling_ignored_during_execution: _items(PreferredSchedulingTerm) = Field(default_factory=list)


class PodAffinityTerm(Strict):
    label_selector: Optional[LabelSelector] = None
    namespaces: _items(DNSLabel) = Field(default_factory=list)
    topology_key: QualifiedName


class WeightedPodAffinityTerm(Strict):
    weight: int = Field(ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(Strict):
    required_during_scheduling_ignored_during_execution: _items(PodAffinityTerm) = Field(default_factory=list)
    preferred_during_scheduling_ignored_during_execution: _items(WeightedPodAffinityTerm) = Field(
        default_factory=list)


class Affinity(Strict):
    """core/v1 Affinity."""

    node_affinity: Optional[NodeAffinity] = None
    pod_affinity: Optional[PodAffinity] = None
    pod_anti_affinity: Optional[PodAffinity] = None


class Toleration(Strict):
    """core/v1 Toleration."""

    key: Optional[QualifiedName] = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: Optional[LabelValue] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None
    # int32, not int64: the CRD schema's maximum goes through a float64, which 2**63 - 1 overflows.
    toleration_seconds: Optional[int] = Field(None, ge=0, le=kube_rules.INT32_MAX)

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        if self.operator == "Exists" and self.value:
            raise ValueError("value must be empty with operator Exists")
        if self.operator == "Equal" and not self.key:
            raise ValueError("key is required with operator Equal (an empty key needs operator Exists)")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds is only used with effect NoExecute")
        return self


class TopologySpreadConstraint(Strict):
    """core/v1 TopologySpreadConstraint."""

    max_skew: int = Field(ge=1, le=kube_rules.INT32_MAX)
    topology_key: QualifiedName
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: Optional[LabelSelector] = None


# -- volumes -------------------------------------------------------------------------------------
class EmptyDirSource(Strict):
    medium: Literal["", "Memory"] = ""
    size_limit: Optional[Quantity] = None


HOST_PATH_TYPES = ("", "DirectoryOrCreate", "Directory", "FileOrCreate", "File", "Socket", "CharDevice", "BlockDevice")


class HostPathSource(Strict):
    path: AbsolutePath
    type: Literal[HOST_PATH_TYPES] = ""  # type: ignore[valid-type]


class ClaimSource(Strict):
    claim_name: DNSSubdomain
    read_only: bool = False


class KeyToPath(Strict):
    key: ConfigKey
    path: RelativePath
    mode: Optional[FileMode] = None


class ConfigMapSource(Strict):
    name: DNSSubdomain
    items: _items(KeyToPath) = Field(default_factory=list)
    default_mode: Optional[FileMode] = None
    optional: bool = False


class SecretSource(Strict):
    secret_name: DNSSubdomain
    items: _items(KeyToPath) = Field(default_factory=list)
    default_mode: Optional[FileMode] = None
    optional: bool = False


VOLUME_SOURCES = ("emptyDir", "hostPath", "persistentVolumeClaim", "configMap", "secret")


class Volume(Strict):
    """A core/v1 Volume with one of the sources an AFD pod may use."""

    name: DNSLabel
    empty_dir: Optional[EmptyDirSource] = None
    host_path: Optional[HostPathSource] = None
    persistent_volume_claim: Optional[ClaimSource] = None
    config_map: Optional[ConfigMapSource] = None
    secret: Optional[SecretSource] = None

    @model_validator(mode="after")
    def _one_source(self) -> "Volume":
        exactly_one(self, VOLUME_SOURCES)
        return self


class VolumeMount(Strict):
    name: DNSLabel
    mount_path: AbsolutePath
    read_only: bool = False
    sub_path: Optional[RelativePath] = None


# -- environment -------------------------------------------------------------------------------
FIELD_PATHS = ("metadata.name", "metadata.namespace", "metadata.uid", "spec.nodeName", "spec.serviceAccountName",
               "status.hostIP", "status.podIP", "status.podIPs")
RESOURCE_FIELDS = ("limits.cpu", "limits.memory", "limits.ephemeral-storage", "requests.cpu", "requests.memory",
                   "requests.ephemeral-storage")


def _field_path(value: str) -> Optional[str]:
    for prefix in ("metadata.labels['", "metadata.annotations['"):
        if value.startswith(prefix) and value.endswith("']"):
            return kube_rules.qualified_name(value[len(prefix):-2])
    if value not in FIELD_PATHS:
        return f"must be one of {', '.join(FIELD_PATHS)}, metadata.labels['KEY'] or metadata.annotations['KEY']"
    return None


class ObjectFieldSelector(Strict):
    field_path: Annotated[str, follows(_field_path)]
    api_version: Literal["v1"] = "v1"


class ResourceFieldSelector(Strict):
    resource: Literal[RESOURCE_FIELDS]  # type: ignore[valid-type]
    container_name: Optional[Literal["attention", "ffn"]] = None
    divisor: Optional[Quantity] = None


class KeySelector(Strict):
    name: DNSSubdomain
    key: ConfigKey
    optional: bool = False


class EnvVarSource(Strict):
    """core/v1 EnvVarSource: exactly one of its references."""

    field_ref: Optional[ObjectFieldSelector] = None
    resource_field_ref: Optional[ResourceFieldSelector] = None
    config_map_key_ref: Optional[KeySelector] = None
    secret_key_ref: Optional[KeySelector] = None

    @model_validator(mode="after")
    def _one_reference(self) -> "EnvVarSource":
        exactly_one(self, ("fieldRef", "resourceFieldRef", "configMapKeyRef", "secretKeyRef"))
        return self


# -- network -----------------------------------------------------------------------------------------
class IPBlock(Strict):
    cidr: Annotated[str, follows(kube_rules.cidr)]
    except_: _items(Annotated[str, follows(kube_rules.cidr)]) = Field(default_factory=list, alias="except")


class NetworkPolicyPeer(Strict):
    """networking.k8s.io/v1 NetworkPolicyPeer: pods (by namespace and pod labels) or addresses."""

    pod_selector: Optional[LabelSelector] = None
    namespace_selector: Optional[LabelSelector] = None
    ip_block: Optional[IPBlock] = None

    @model_validator(mode="after")
    def _one_kind(self) -> "NetworkPolicyPeer":
        selects = self.pod_selector is not None or self.namespace_selector is not None
        if selects == (self.ip_block is not None):
            raise ValueError("set podSelector and/or namespaceSelector, or ipBlock alone")
        return self


class NetworkPolicyPort(Strict):
    """networking.k8s.io/v1 NetworkPolicyPort: one port by number (an egress rule names the
    peer's port, whose names the policy's namespace cannot know)."""

    protocol: Literal["TCP", "UDP", "SCTP"] = "TCP"
    port: Annotated[int, Field(ge=1, le=65535)]


class NetworkPolicyEgressRule(Strict):
    """networking.k8s.io/v1 NetworkPolicyEgressRule, with its peers and ports both required:
    an admin's grant names where and on which ports."""

    to: Annotated[list[NetworkPolicyPeer], Field(min_length=1, max_length=MAX_LIST_ITEMS)]
    ports: Annotated[list[NetworkPolicyPort], Field(min_length=1, max_length=MAX_LIST_ITEMS)]

