"""How a problem with an object is told (its field path and the rule, one printable line each)
and the shape raw input must have before any model reads it: what JSON and the API server
can carry, checked without recursion so no input can exhaust the stack."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Union

from pydantic import ValidationError

from . import kube_rules

# The raw object: nesting, values visited (aliases of a YAML file count each time they are
# reached) and string length. The API server takes at most 3 MiB per request.
MAX_DEPTH = 32
MAX_NODES = 100_000
MAX_STRING_BYTES = 256 * 1024
# How much of a field path or message one line of output shows.
MAX_SHOWN = 300


def printable(text: str) -> str:
    """`text` on one line: control characters escaped, long text cut."""
    shown = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return shown if len(shown) <= MAX_SHOWN else shown[:MAX_SHOWN] + "..."


@dataclass(frozen=True, order=True)
class Problem:
    path: str
    message: str

    def __str__(self) -> str:
        return f"{printable(self.path)}: {printable(self.message)}"


def _loc_to_path(prefix: str, loc: tuple[Union[str, int], ...]) -> str:
    path = prefix
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif part != "[key]":  # a map key that breaks a rule: its path is the entry's
            path += ("." if path else "") + part
    return path


def pydantic_problems(err: ValidationError, prefix: str) -> list[Problem]:
    problems = []
    for e in err.errors():
        path = _loc_to_path(prefix, e["loc"])
        if e["type"] == "extra_forbidden":
            msg = "unknown field (not part of the AFDDeployment API; field names are camelCase)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if e["loc"] and e["loc"][-1] == "[key]":
                msg = f"key: {msg}"
        problems.append(Problem(path, msg))
    return sorted(set(problems), key=problems.index)


def check_shape(obj: Any, root: str) -> list[Problem]:
    """What JSON and the API server can carry, before any model reads the object: nesting at
    most MAX_DEPTH, at most MAX_NODES values, string keys, finite numbers in int64, strings
    without NUL. Iterative, so no input can exhaust the stack."""
    problems: list[Problem] = []
    stack: list[tuple[str, Any, int]] = [(root, obj, 0)]
    visited = 0
    while stack:
        path, value, depth = stack.pop()
        visited += 1
        if visited > MAX_NODES:
            return [Problem(root or "<document>", f"more than {MAX_NODES} values (YAML aliases count each time "
                                                  "they are used); an AFDDeployment is far smaller")]
        if isinstance(value, (dict, list)) and depth >= MAX_DEPTH:
            problems.append(Problem(path, f"nested deeper than {MAX_DEPTH} levels"))
            continue
        if isinstance(value, dict):
            for key, item in value.items():
                if not isinstance(key, str):
                    problems.append(Problem(f"{path}.{key!r}", "keys must be strings"))
                    continue
                stack.append((f"{path}.{key}" if path else key, item, depth + 1))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item, depth + 1) for i, item in enumerate(value))
        elif isinstance(value, float) and not math.isfinite(value):
            problems.append(Problem(path, "must be a finite number (JSON has no NaN or infinity)"))
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > kube_rules.INT64_MAX:
            problems.append(Problem(path, "must fit in 64 bits"))
        elif isinstance(value, str):
            if len(value) > MAX_STRING_BYTES:
                problems.append(Problem(path, f"must be at most {MAX_STRING_BYTES} characters"))
            elif "\x00" in value:
                problems.append(Problem(path, "must not contain a NUL character"))
        elif not (value is None or isinstance(value, (bool, int, float))):
            problems.append(Problem(path, f"a {type(value).__name__} value is not JSON (quote it to make it a string)"))
    return sorted(problems)
