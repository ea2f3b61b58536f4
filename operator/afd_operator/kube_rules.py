"""The API server's own rules for the values an AFDDeployment passes through to the objects the
operator renders (k8s.io/apimachinery/pkg/util/validation, resource.Quantity, core/v1
validation). Each check returns None when the value is fine, else the rule it breaks, so a
spec the API server would refuse is refused first, with the field's path.
"""

from __future__ import annotations

import ipaddress
import re
from decimal import Decimal, InvalidOperation
from typing import Any, Optional

DNS_LABEL_MAX = 63
DNS_SUBDOMAIN_MAX = 253
QUALIFIED_NAME_MAX = 63
LABEL_VALUE_MAX = 63
# The sum of every annotation key and value on one object (TotalAnnotationSizeLimitB).
ANNOTATIONS_TOTAL_MAX = 256 * 1024
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_DNS_1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_1035_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
_QUALIFIED_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_ENV_NAME = re.compile(r"[-._a-zA-Z][-._a-zA-Z0-9]*")
_CONFIG_KEY = re.compile(r"[-._a-zA-Z0-9]+")
# resource.Quantity's grammar: a signed decimal, then a binary suffix, a decimal suffix or an exponent.
_QUANTITY = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?\d+)?")
_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
             "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def _fits(value: str, pattern: re.Pattern, limit: int, rule: str) -> Optional[str]:
    return None if len(value) <= limit and pattern.fullmatch(value) else rule


def dns_label(value: str) -> Optional[str]:
    return _fits(value, _DNS_1123_LABEL, DNS_LABEL_MAX, f"must be a DNS label: at most {DNS_LABEL_MAX} lowercase "
                 "letters, digits and '-', starting and ending with a letter or digit")


def dns_1035_label(value: str) -> Optional[str]:
    return _fits(value, _DNS_1035_LABEL, DNS_LABEL_MAX, f"must be a DNS-1035 label: at most {DNS_LABEL_MAX} "
                 "lowercase letters, digits and '-', starting with a letter")


def dns_subdomain(value: str) -> Optional[str]:
    return _fits(value, _DNS_1123_SUBDOMAIN, DNS_SUBDOMAIN_MAX, f"must be a DNS subdomain: at most "
                 f"{DNS_SUBDOMAIN_MAX} lowercase letters, digits, '-' and '.', starting and ending with a letter or "
                 "digit")


def qualified_name(value: str) -> Optional[str]:
    """A label or annotation key: `[prefix/]name`, the prefix a DNS subdomain."""
    prefix, slash, name = value.rpartition("/")
    if slash and (not prefix or dns_subdomain(prefix)):
        return "must be '[prefix/]name' with a DNS subdomain prefix (e.g. 'example.com/my-key')"
    if len(name) > QUALIFIED_NAME_MAX or not _QUALIFIED_NAME.fullmatch(name):
        return (f"must be a qualified name: at most {QUALIFIED_NAME_MAX} letters, digits, '-', '_' and '.' after "
                "an optional 'prefix/', starting and ending with a letter or digit")
    return None


def label_value(value: str) -> Optional[str]:
    if value and (len(value) > LABEL_VALUE_MAX or not _QUALIFIED_NAME.fullmatch(value)):
        return (f"must be a label value: empty, or at most {LABEL_VALUE_MAX} letters, digits, '-', '_' and '.', "
                "starting and ending with a letter or digit")
    return None


def env_name(value: str) -> Optional[str]:
    if not _ENV_NAME.fullmatch(value):
        return "must consist of letters, digits, '_', '-' or '.', and not start with a digit"
    return None


def config_key(value: str) -> Optional[str]:
    """A ConfigMap or Secret key."""
    if len(value) > DNS_SUBDOMAIN_MAX or not _CONFIG_KEY.fullmatch(value):
        return f"must be a key of at most {DNS_SUBDOMAIN_MAX} letters, digits, '-', '_' and '.'"
    return None


def absolute_path(value: str) -> Optional[str]:
    if not value.startswith("/"):
        return "must be an absolute path"
    if ".." in value.split("/"):
        return "must not contain '..'"
    return None


def relative_path(value: str) -> Optional[str]:
    if value.startswith("/"):
        return "must be a relative path"
    if ".." in value.split("/"):
        return "must not contain '..'"
    return None


def cidr(value: str) -> Optional[str]:
    try:
        if "/" in value:
            ipaddress.ip_network(value, strict=False)
            return None
    except ValueError:
        pass
    return "must be a CIDR such as '10.0.0.0/8'"


def quantity_value(value: Any) -> Decimal:
    """The value of a Kubernetes quantity: a string in resource.Quantity's grammar (no spaces),
    or a JSON integer. Raises ValueError with the rule otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError("must be a quantity string such as '500m' or '4Gi', or an integer")
    text = str(value)
    match = _QUANTITY.fullmatch(text)
    if match is None:
        raise ValueError(f"'{text}' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)")
    suffix = match.group(3) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(text)
        return Decimal(text[:len(text) - len(suffix)]) * _SUFFIXES[suffix]
    except InvalidOperation:
        raise ValueError(f"'{text}' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)") from None


def quantity(value: Any, *, positive: bool = False) -> Optional[str]:
    """A quantity the API server stores: not negative (resources never are), at most int64."""
    try:
        amount = quantity_value(value)
    except ValueError as err:
        return str(err)
    if amount < 0 or (positive and amount == 0):
        return f"must be {'positive' if positive else 'at least 0'} (got {value})"
    if amount > INT64_MAX:
        return f"must be at most {INT64_MAX} (got {value})"
    return None


def extended_resource_name(value: str) -> Optional[str]:
    """A device plugin's resource: `domain/name`, outside the kubernetes.io domains."""
    prefix = value.partition("/")[0]
    if "/" not in value or qualified_name(value) or prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return "must be an extended resource name like 'vendor.example/device'"
    return None
