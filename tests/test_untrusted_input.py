"""Untrusted AFDDeployment files through `afdctl validate`: each class of bad input found by
mutating specs gets one answer, one line per problem (`FILE: field.path: rule`), exit 1, never
a traceback (the webhook and the operator run the same validation)."""

from __future__ import annotations

import copy
import io
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import yaml

from afd_operator.cli import main
from afd_operator.problems import MAX_DEPTH, MAX_NODES
from afd_operator.validation import validate_object, validate_spec
from k8s_helpers import set_path


def base() -> dict[str, Any]:
    return {
        "apiVersion": "afd.inference.dev/v1alpha1", "kind": "AFDDeployment",
        "metadata": {"name": "tiny", "namespace": "ns"},
        "spec": {"image": "runtime:v1", "platform": "cpu",
                 "model": {"name": "m", "path": "/models/m", "routedExperts": 8},
                 "attention": {"dataParallel": 2}, "ffn": {"ranks": 2}},
    }


def changed(path: str, value: Any) -> bytes:
    return yaml.safe_dump(set_path(copy.deepcopy(base()), path, value)).encode()


def nested(levels: int) -> str:
    """A flow mapping `levels` deep (PyYAML's own dumper recurses too deep to write one)."""
    return "{a: " * levels + "1" + "}" * levels


def validate(tmp_path: Path, data: bytes) -> tuple[int, Path, list[str]]:
    path = tmp_path / "input.yaml"
    path.write_bytes(data)
    out, err = io.StringIO(), io.StringIO()
    code = main(["validate", "-f", str(path)], out=out, err=err)
    return code, path, err.getvalue().splitlines()


BASE_TEXT = yaml.safe_dump(base())
RES = "spec.attention.podTemplate.resources"
# (case id, file bytes, expected field path, fragment of the rule)
CASES: list[tuple[str, Callable[[], bytes], str, str]] = [
    ("binary", lambda: bytes(range(256)), "<file>", "is not UTF-8 text (byte 0x80 at offset 128)"),
    ("utf-16", lambda: BASE_TEXT.encode("utf-16"), "<file>", "is UTF-16 text; AFDDeployment files must be UTF-8"),
    ("latin-1", lambda: BASE_TEXT.replace("runtime:v1", "runtime:vé").encode("latin-1"), "<file>",
     "is not UTF-8 text (byte 0xe9"),
    ("nested-300-flow", lambda: ("spec: " + "[" * 300 + "]" * 300 + "\n").encode(), "<yaml>",
     f"nested deeper than {MAX_DEPTH} levels"),
    ("nested-3000", lambda: f"spec: {nested(3000)}\n".encode(), "<yaml>", f"nested deeper than {MAX_DEPTH} levels"),
    ("nested-block", lambda: "".join(f"{' ' * i}k{i}:\n" for i in range(400)).encode(), "<yaml>",
     f"nested deeper than {MAX_DEPTH} levels"),
    ("nested-extra-config", lambda: changed("spec.connector.extraConfig", "X").replace(b"X", nested(500).encode()),
     "<yaml>", f"nested deeper than {MAX_DEPTH} levels"),
    ("nan-quantity", lambda: changed(RES, {"requests": {"cpu": math.nan}}), f"{RES}.requests.cpu",
     "must be a finite number"),
    ("inf-quantity", lambda: changed(RES, {"limits": {"cpu": math.inf}}), f"{RES}.limits.cpu",
     "must be a finite number"),
    ("null-requests", lambda: changed(RES, {"requests": None}), f"{RES}.requests", "valid dictionary"),
    ("boolean-quantity", lambda: changed(RES, {"requests": {"cpu": True}}), f"{RES}.requests.cpu",
     "must be a quantity string such as '500m' or '4Gi', or an integer"),
    ("spaced-quantity", lambda: changed(RES, {"requests": {"cpu": " 2"}}), f"{RES}.requests.cpu",
     "' 2' is not a Kubernetes quantity"),
    ("float-quantity", lambda: changed(RES, {"requests": {"cpu": 0.5}}), f"{RES}.requests.cpu",
     "must be a quantity string"),
    ("empty-resource-name", lambda: changed(RES, {"requests": {"": "1"}}), f"{RES}.requests.", "key: must be cpu"),
    ("long-name-many-replicas", lambda: changed("metadata.name", "a" * 40).replace(b"image:", b"replicas: 10001\n  image:"),
     "spec.replicas", "less than or equal to 512"),
    ("long-name", lambda: changed("metadata.name", "a" * 41), "metadata.name", "must be at most 40 characters"),
    ("service-account", lambda: changed("spec.ffn.podTemplate.serviceAccountName", "a b"),
     "spec.ffn.podTemplate.serviceAccountName", "must be a DNS subdomain"),
    ("priority-class", lambda: changed("spec.scheduling.priorityClassName", "High_Priority"),
     "spec.scheduling.priorityClassName", "must be a DNS subdomain"),
    ("label-key", lambda: changed("spec.ffn.podTemplate.labels", {"bad key": "x"}),
     "spec.ffn.podTemplate.labels.bad key", "key: must be a qualified name"),
    ("label-value", lambda: changed("spec.ffn.podTemplate.labels", {"team": "a/b"}),
     "spec.ffn.podTemplate.labels.team", "must be a label value"),
    ("annotation-key", lambda: changed("spec.ffn.podTemplate.annotations", {"/x": "y"}),
     "spec.ffn.podTemplate.annotations./x", "key: must be '[prefix/]name'"),
    ("node-selector-value", lambda: changed("spec.attention.podTemplate.nodeSelector", {"pool": "n p u"}),
     "spec.attention.podTemplate.nodeSelector.pool", "must be a label value"),
    ("grace-1e30", lambda: changed("spec.termination.gracePeriodSeconds", 1e30),
     "spec.termination.gracePeriodSeconds", "valid integer"),
    ("grace-huge-int", lambda: changed("spec.termination.gracePeriodSeconds", 10 ** 12),
     "spec.termination.gracePeriodSeconds", "less than or equal to 604800"),
    ("replicas-2^31", lambda: changed("spec.replicas", 2 ** 31), "spec.replicas", "less than or equal to 512"),
    ("surge-1e9-float", lambda: changed("spec.updateStrategy.maxSurge", 1e9), "spec.updateStrategy.maxSurge",
     "must be an integer or a percentage"),
    ("surge-1e9", lambda: changed("spec.updateStrategy.maxSurge", 10 ** 9), "spec.updateStrategy.maxSurge",
     "must be in [0, 512]"),
    ("ffn-ranks-2^31", lambda: changed("spec.ffn.ranks", 2 ** 31), "spec.ffn.ranks", "less than or equal to 1024"),
    ("newline-key", lambda: changed("spec.connector.extraConfig", {"a\nb": 1}), "spec.connector.extraConfig.a\\nb",
     "the plugin refuses it: afd.connector_extra_config.a\\nb: unknown key"),
    ("snake-case", lambda: changed("spec.attention", {"data_parallel": 2}), "spec.attention.data_parallel",
     "unknown field"),
    ("other-case", lambda: changed("spec.attention", {"DataParallel": 2}), "spec.attention.DataParallel",
     "unknown field"),
    ("duplicate-key", lambda: BASE_TEXT.replace("image: runtime:v1", "image: runtime:v1\n  image: runtime:v2").encode(),
     "spec.image", "duplicate key (lines"),
    ("alias-bomb", lambda: ("a: &a [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n"
                            + "".join(f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, "
                                      f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
                                      f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n"
                                      for i in range(8))).encode(),
     "<document>", f"more than {MAX_NODES} values"),
    ("not-a-mapping", lambda: b"- 1\n- 2\n", "<document>", "must be a mapping"),
    ("bad-int-tag", lambda: b"spec: !!int nine\n", "<yaml>", "cannot read a value"),
    ("nul-in-string", lambda: changed("spec.image", "runtime\x00:v1"), "spec.image", "must not contain a NUL"),
    ("reserved-label", lambda: changed("spec.ffn.podTemplate.labels", {"afd.inference.dev/serving": "true"}),
     "spec.ffn.podTemplate.labels", "are set by the operator"),
    ("hostpath-read-write", lambda: changed("spec.ffn.podTemplate", {
        "volumes": [{"name": "data", "hostPath": {"path": "/data"}}],
        "volumeMounts": [{"name": "data", "mountPath": "/data"}]}),
     "spec.ffn.podTemplate.volumeMounts[0].readOnly", "must be true: host paths are mounted read-only"),
    ("operator-volume-name", lambda: changed("spec.ffn.podTemplate.volumes", [{"name": "dshm", "emptyDir": {}}]),
     "spec.ffn.podTemplate.volumes[0].name", "'dshm' is a volume of the operator"),
    ("operator-mount-path", lambda: changed("spec.ffn.podTemplate.volumeMounts", [{"name": "dshm", "mountPath": "/tmp/"}]),
     "spec.ffn.podTemplate.volumeMounts[0].mountPath", "already used by the operator's volume 'scratch'"),
    ("model-on-scratch", lambda: changed("spec.model", {"name": "m", "path": "/tmp/m",
                                                        "volume": {"claimName": "w", "mountPath": "/tmp"}}),
     "spec.model.volume.mountPath", "'/tmp' is already mounted by the operator (volume 'scratch')"),
    ("driver-path-twice", lambda: changed("spec.platform", "ascend").replace(
        b"platform: ascend", b"platform: ascend\n  ascend: {hostNetwork: false, driverHostPaths: [/opt/d, /opt/d/]}"),
     "spec.ascend.driverHostPaths[1]", "'/opt/d/' is already mounted by the operator (volume 'ascend-host-0')"),
    ("unknown-volume-source", lambda: changed("spec.ffn.podTemplate.volumes", [{"name": "n", "nfs": {"server": "x"}}]),
     "spec.ffn.podTemplate.volumes[0].nfs", "unknown field"),
    ("toleration-typo", lambda: changed("spec.ffn.podTemplate.tolerations", [{"keyy": "x", "operator": "Exists"}]),
     "spec.ffn.podTemplate.tolerations[0].keyy", "unknown field"),
    ("too-many-ranks", lambda: changed("spec.attention", {"dataParallel": 1024, "tensorParallel": 2, "devicesPerPod": 2}),
     "spec.attention.dataParallel", "must be at most 1024 Attention ranks"),
    ("too-many-pods", lambda: changed("spec.replicas", 512).replace(b"ranks: 2", b"ranks: 16"),
     "spec.replicas", "must be at most 8192 pods"),
]


def test_enough_classes() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize("make,path,rule", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_gets_one_line_per_problem(tmp_path: Path, make: Callable[[], bytes], path: str, rule: str) -> None:
    code, file, lines = validate(tmp_path, make())
    assert code == 1, lines
    assert lines and all(line.startswith(f"{file}: ") for line in lines), lines
    assert not any("Traceback" in line or "could not be validated" in line for line in lines), lines
    assert any(line.startswith(f"{file}: {path}: ") and rule in line for line in lines), lines


def test_the_same_object_gets_the_same_answer_from_every_entry_point() -> None:
    """What afdctl reads from a file, the webhook gets as an object and the operator as a spec."""
    obj = yaml.safe_load(changed(RES, {"requests": {"cpu": " 2"}, "limits": {"memory": "1Gi"}}))
    _, from_object = validate_object(obj)
    _, from_spec = validate_spec(obj["spec"], obj["metadata"]["name"], namespace="ns")
    assert [str(p) for p in from_object] == [str(p) for p in from_spec] == [
        f"{RES}.requests.cpu: ' 2' is not a Kubernetes quantity (e.g. 500m, 2, 4Gi)"]


def test_timestamps_stay_strings_as_kubernetes_reads_them(tmp_path: Path) -> None:
    code, _, lines = validate(tmp_path, changed("spec.image", "placeholder").replace(b"placeholder", b"2024-01-01"))
    assert (code, lines) == (0, [])


def test_a_merge_key_may_be_overridden(tmp_path: Path) -> None:
    text = BASE_TEXT.replace("spec:", "defaults: &d {image: other:v1}\nspec:").replace("  image: runtime:v1",
                                                                                  "  <<: *d\n  image: runtime:v1")
    code, file, lines = validate(tmp_path, text.encode())
    assert code == 1 and lines == [f"{file}: defaults: unknown field (not part of the AFDDeployment API; field names "
                                   "are camelCase)"]


def test_a_validator_failure_is_one_problem_not_a_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    import afd_operator.validation as validation

    def broken(*_: Any, **__: Any) -> list:
        raise ZeroDivisionError("a rule's bug")

    monkeypatch.setattr(validation, "check_spec", broken)
    assert [str(p) for p in validate_object(base())[1]] == [
        "<document>: could not be validated (ZeroDivisionError: a rule's bug)"]
    assert [str(p) for p in validate_spec(base()["spec"], "tiny")[1]] == [
        "spec: could not be validated (ZeroDivisionError: a rule's bug)"]
