"""The chart's alerts (templates/alerts.yaml): off by default; rendered by real helm, they pass
`promtool check rules` and the promtool unit tests of tests/fixtures/alerts.test.yaml (each alert
fires on its condition after its `for`, and not before or on the neighbouring case); their
thresholds come from the values; they name only metrics the operator and the runtime export."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from k8s_helpers import Helm
from test_chart import find, helm4, operator_metric_names, render  # noqa: F401 (helm4: a fixture)

ALERTS_TEST = Path(__file__).resolve().parent / "fixtures" / "alerts.test.yaml"
ALERTS = {"AFDInstanceFailed", "AFDInstanceNotReady", "AFDInstanceRestartsHigh", "AFDOperatorReconcileErrors",
          "AFDReplyWaitHigh", "AFDRuntimeErrors"}


def rendered_rules(helm: Helm, repo_root: Path, *args: str) -> list[dict]:
    """The rule groups of the chart's PrometheusRule, rendered with alerts on and `args`."""
    (rule,) = find(render(helm, repo_root, "--set", "alerts.enabled=true", *args), "PrometheusRule")
    assert rule["metadata"]["name"] == "afd-operator-alerts"
    return rule["spec"]["groups"]


def promtool(*args: str) -> subprocess.CompletedProcess:
    binary = shutil.which("promtool")
    assert binary, "promtool (Debian package prometheus) is required"
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=120)


def test_alerts_are_off_by_default(helm4: Helm, repo_root: Path) -> None:
    assert find(render(helm4, repo_root), "PrometheusRule") == []


def test_alerts_pass_promtool_and_their_unit_tests(helm4: Helm, repo_root: Path, tmp_path: Path) -> None:
    groups = rendered_rules(helm4, repo_root, "--set", "alerts.alertLabels.team=ml",
                            "--set", "alerts.labels.release=prometheus")
    assert {r["alert"] for g in groups for r in g["rules"]} == ALERTS
    (tmp_path / "rules.yaml").write_text(yaml.safe_dump({"groups": groups}))
    shutil.copy(ALERTS_TEST, tmp_path / ALERTS_TEST.name)
    checked = promtool("check", "rules", str(tmp_path / "rules.yaml"))
    assert checked.returncode == 0 and f"{len(ALERTS)} rules found" in checked.stdout, checked.stdout + checked.stderr
    tested = promtool("test", "rules", str(tmp_path / ALERTS_TEST.name))
    assert tested.returncode == 0 and "SUCCESS" in tested.stdout, tested.stdout + tested.stderr


def test_alert_thresholds_and_labels_come_from_the_values(helm4: Helm, repo_root: Path) -> None:
    (rule,) = find(render(helm4, repo_root, "--set", "alerts.enabled=true", "--set", "alerts.labels.release=prom",
                          "--set", "alerts.replyWaitP99Seconds=2", "--set", "alerts.restartsPerHour=5",
                          "--set", "alerts.instanceNotReadyFor=40m"), "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prom"
    by_name = {r["alert"]: r for g in rule["spec"]["groups"] for r in g["rules"]}
    assert by_name["AFDReplyWaitHigh"]["expr"].endswith("> 2")
    assert by_name["AFDInstanceRestartsHigh"]["expr"].endswith(">= 5")
    assert by_name["AFDInstanceNotReady"]["for"] == "40m"
    assert "more than 40m" in by_name["AFDInstanceNotReady"]["annotations"]["description"]


def test_alerts_name_only_existing_metrics(helm4: Helm, repo_root: Path) -> None:
    used = {name for g in rendered_rules(helm4, repo_root) for r in g["rules"]
            for name in re.findall(r"\bafd_[a-z_]+\b", r["expr"])}
    assert used <= operator_metric_names(), used - operator_metric_names()
    assert {"afd_operator_instances", "afd_attention_reply_wait_seconds_bucket", "afd_errors_total"} <= used
