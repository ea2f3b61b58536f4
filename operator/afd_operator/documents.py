"""AFDDeployment files as afdctl reads them: bytes -> YAML documents, or one problem per fault
(never an exception), refusing what kubectl could not send as JSON or would read differently:
text that is not UTF-8, duplicate keys (both lines named), nesting past validation.MAX_DEPTH.
Timestamps stay strings, as Kubernetes' YAML reader leaves them.
"""

from __future__ import annotations

from typing import Any, Optional

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from .problems import MAX_DEPTH, Problem

# The API server takes at most 3 MiB per request; an AFDDeployment is a few KiB.
MAX_FILE_BYTES = 3 * 1024 * 1024
_BYTE_ORDER_MARKS = {b"\xff\xfe\x00\x00": "UTF-32", b"\x00\x00\xfe\xff": "UTF-32", b"\xff\xfe": "UTF-16",
                     b"\xfe\xff": "UTF-16"}
_MERGE = "tag:yaml.org,2002:merge"


class _TooDeep(Exception):
    def __init__(self, line: int):
        super().__init__(line)
        self.line = line


class _Loader(yaml.SafeLoader):
    """SafeLoader that stops composing past MAX_DEPTH (its composer recurses per level) and
    resolves no timestamps."""

    yaml_implicit_resolvers = {
        first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
        for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }

    def __init__(self, stream: str):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Optional[Node], index: Any) -> Node:
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH + 1:  # the document itself is level 0
                raise _TooDeep(self.peek_event().start_mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _key_text(node: Node) -> str:
    return str(node.value) if isinstance(node, ScalarNode) else f"<{node.id} key>"


def _duplicate_keys(root: Node) -> list[Problem]:
    """Keys given twice in one mapping, each with both lines (a merge key's entries may be
    overridden: that is what merging is for)."""
    problems, seen_nodes, stack = [], set(), [("", root)]
    while stack:
        path, node = stack.pop()
        if id(node) in seen_nodes:  # an alias: its node was checked where it was anchored
            continue
        seen_nodes.add(id(node))
        if isinstance(node, MappingNode):
            first_line: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                if key_node.tag == _MERGE:
                    continue
                key, line = _key_text(key_node), key_node.start_mark.line + 1
                child = f"{path}.{key}" if path else key
                if (key_node.tag, key) in first_line:
                    problems.append(Problem(child, f"duplicate key (lines {first_line[(key_node.tag, key)]} and "
                                                   f"{line}); each key may be given once"))
                else:
                    first_line[(key_node.tag, key)] = line
                stack.append((child, value_node))
        elif isinstance(node, SequenceNode):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(node.value))
    return sorted(problems)


def _yaml_problem(err: yaml.YAMLError) -> Problem:
    if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
        mark = err.problem_mark
        context = f" {err.context}" if err.context else ""
        return Problem("<yaml>", f"{err.problem}{context} (line {mark.line + 1}, column {mark.column + 1})")
    return Problem("<yaml>", " ".join(str(err).split()))


def decode(data: bytes) -> tuple[Optional[str], list[Problem]]:
    """The text of a file, or why it is not UTF-8 text of a sensible size."""
    if len(data) > MAX_FILE_BYTES:
        return None, [Problem("<file>", f"larger than {MAX_FILE_BYTES} bytes (the API server's request limit)")]
    for mark, encoding in _BYTE_ORDER_MARKS.items():
        if data.startswith(mark):
            return None, [Problem("<file>", f"is {encoding} text; AFDDeployment files must be UTF-8")]
    try:
        return data.decode("utf-8-sig"), []
    except UnicodeDecodeError as err:
        return None, [Problem("<file>", f"is not UTF-8 text (byte 0x{data[err.start]:02x} at offset {err.start})")]


def read_documents(data: bytes) -> tuple[list[Any], list[Problem]]:
    """The non-empty YAML documents of a file, or the problems that stop it being read."""
    text, problems = decode(data)
    if text is None:
        return [], problems
    loader, documents = None, []
    try:
        loader = _Loader(text)  # its reader refuses control characters at once
        while loader.check_node():
            node = loader.get_node()
            problems += _duplicate_keys(node)
            if not problems:
                documents.append(loader.construct_document(node))
    except _TooDeep as err:
        return [], [Problem("<yaml>", f"nested deeper than {MAX_DEPTH} levels (line {err.line})")]
    except yaml.YAMLError as err:
        return [], [_yaml_problem(err)]
    except (ValueError, TypeError, OverflowError) as err:  # a tagged scalar its constructor cannot read
        return [], [Problem("<yaml>", f"cannot read a value: {err}")]
    finally:
        if loader is not None:
            loader.dispose()
    if problems:
        return [], problems
    return [d for d in documents if d is not None], []
