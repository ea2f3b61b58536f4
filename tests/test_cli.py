"""`afdctl`: exit codes, messages on stderr, deterministic output."""

from __future__ import annotations

import io
import re
import subprocess
import sys
from pathlib import Path

import yaml

from afd_operator.cli import main

BAD = """\
apiVersion: afd.inference.dev/v1alpha1
kind: AFDDeployment
metadata: {name: bad}
spec:
  replicas: -2
  image: x
  model: {name: m, path: /m, routedExperts: 10}
  ffn: {ranks: 4, devicesPerPod: 4}
  attention: {tensorParalel: 2}
"""


def run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


def test_validate_examples(examples: list[Path]) -> None:
    args = [a for p in examples for a in ("-f", str(p))]
    code, out, err = run("validate", *args)
    assert (code, err) == (0, "")
    assert out.count(": valid") == len(examples)


def test_validate_lists_every_problem(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    code, out, err = run("validate", "-f", str(bad))
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert f"{bad}: spec.replicas: Input should be greater than or equal to 0" in lines
    assert (f"{bad}: spec.attention.tensorParalel: unknown field (not part of the AFDDeployment API; field names "
            "are camelCase)") in lines


def test_cross_field_problems_on_stderr(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD.replace("replicas: -2", "replicas: 1").replace("  attention: {tensorParalel: 2}\n", ""))
    code, _, err = run("validate", "-f", str(bad))
    assert code == 1
    assert "spec.ffn.ranks: must divide model.routedExperts (10)" in err


def test_multi_document_and_yaml_errors(tmp_path: Path, examples: list[Path]) -> None:
    multi = tmp_path / "multi.yaml"
    multi.write_text(examples[0].read_text() + "\n---\n" + BAD)
    code, out, err = run("validate", "-f", str(multi))
    assert code == 1 and f"{multi}#2: spec.replicas" in err and out == ""
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed\n")
    code, _, err = run("validate", "-f", str(broken))
    assert code == 1 and f"{broken}: <yaml>:" in err


def test_plan_table(examples: list[Path]) -> None:
    small = next(p for p in examples if p.name == "small-ascend.yaml")
    code, out, _ = run("plan", "-f", str(small))
    assert code == 0
    assert "topology DP2xTP2+EP4" in out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] == ["0"]]
    # INSTANCE POD ROLE RANKS WORLD DEVICES DP-START [HEAD] PORTS
    assert [(r[2], r[3], r[4], r[6]) for r in rows] == [
        ("ffn", "0-1", "4-5", "-"), ("ffn", "2-3", "6-7", "-"),
        ("attention", "0-1", "0-1", "0"), ("attention", "2-3", "2-3", "1"),
    ]


def test_render_is_deterministic_yaml(examples: list[Path]) -> None:
    args = [a for p in examples for a in ("-f", str(p))]
    first, second = run("render", *args), run("render", *args)
    assert first == second and first[0] == 0
    objs = list(yaml.safe_load_all(first[1]))
    assert {o["kind"] for o in objs} >= {"Pod", "Service", "ConfigMap", "PodDisruptionBudget"}
    code, out, _ = run("render", "--owner-uid", "1234", "-f", str(examples[0]))
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "1234" for o in yaml.safe_load_all(out))


def test_console_script_exits_as_its_help_documents(tmp_path: Path) -> None:
    """`afdctl --help` documents exit codes 0 (success), 1 (invalid input, every problem on
    stderr as 'FILE: field.path: rule') and 2 (usage error or unreadable file): real runs of the
    installed console script give each of them, and nothing on stdout when they fail."""
    afdctl = str(Path(sys.executable).parent / "afdctl")

    def afdctl_run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([afdctl, *argv], capture_output=True, text=True)

    helped = afdctl_run("--help")
    assert helped.returncode == 0
    assert re.findall(r"\b(\d) [a-z]", " ".join(helped.stdout.split("Exit codes:", 1)[1].split())) == ["0", "1", "2"]

    crd = afdctl_run("crd")
    assert (crd.returncode, crd.stderr) == (0, "")
    assert yaml.safe_load(crd.stdout)["kind"] == "CustomResourceDefinition"

    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD)
    invalid = afdctl_run("validate", "-f", str(bad))
    assert (invalid.returncode, invalid.stdout) == (1, "")
    problems = invalid.stderr.splitlines()
    assert len(problems) == 2, problems
    assert all(re.fullmatch(rf"{re.escape(str(bad))}: spec\.[\w.]+: .+", line) for line in problems), problems

    for usage in (["validate", "-f", str(tmp_path / "missing.yaml")], ["frobnicate"]):
        failed = afdctl_run(*usage)
        assert (failed.returncode, failed.stdout) == (2, ""), (usage, failed.stderr)
        assert failed.stderr, usage


def test_validate_reports_what_the_plugin_refuses(tmp_path: Path, examples: list[Path]) -> None:
    doc = yaml.safe_load(next(p for p in examples if p.name == "cpu-tiny.yaml").read_text())
    doc["spec"]["connector"] = {"extraConfig": {"dynamicQuant": 1, "foo": "bar"}}
    bad = tmp_path / "plugin-refuses.yaml"
    bad.write_text(yaml.safe_dump(doc))
    code, out, err = run("validate", "-f", str(bad))
    assert (code, out) == (1, "")
    assert err.splitlines() == [
        f"{bad}: spec.connector.extraConfig.foo: the plugin refuses it: afd.connector_extra_config.foo: "
        "unknown key; allowed: attn_ranks_per_dp, dynamicQuant, data_plane (got 'bar')"]
    assert run("render", "-f", str(bad))[0] == 1  # nothing is rendered for it either


def with_model(examples: list[Path], tmp_path: Path, checkpoint: Path, **model) -> Path:
    """cpu-tiny.yaml with its model read from ``checkpoint`` through a hostPath volume."""
    doc = yaml.safe_load(next(p for p in examples if p.name == "cpu-tiny.yaml").read_text())
    doc["spec"]["model"].update(path=f"/models/{checkpoint.name}",
                                volume={"hostPath": str(checkpoint.parent), "mountPath": "/models"}, **model)
    path = tmp_path / f"{checkpoint.name}.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_validate_reads_the_checkpoints_config_where_it_is_readable(tmp_path: Path, examples: list[Path]) -> None:
    """The same answer the pods give at start (the plugin's moe_spec): a model the plugin cannot
    serve, experts that do not split over the FFN ranks, a wrong routedExperts; a model
    without shared experts gets a note that the placement does not apply."""
    from afd_devcluster.checkpoints import model_config, write_config_checkpoint

    mixtral = write_config_checkpoint(tmp_path / "mixtral", {**model_config("qwen2_moe"), "model_type": "mixtral"})
    code, out, err = run("validate", "-f", str(with_model(examples, tmp_path, mixtral)))
    assert (code, out) == (1, "")
    assert "spec.model.path: " in err and "model_type must be one of" in err and "(got 'mixtral')" in err

    six = write_config_checkpoint(tmp_path / "kimi-6", model_config("kimi_k2", experts=6))
    code, _, err = run("validate", "-f", str(with_model(examples, tmp_path, six, routedExperts=8)))
    assert code == 1
    assert "spec.model.routedExperts: the checkpoint" in err and "has 6 routed experts; got 8" in err
    five = write_config_checkpoint(tmp_path / "kimi-5", model_config("kimi_k2", experts=5))
    code, _, err = run("validate", "-f", str(with_model(examples, tmp_path, five)))
    assert code == 1 and "spec.ffn.ranks: must divide the checkpoint's 5 routed experts" in err

    qwen3 = write_config_checkpoint(tmp_path / "qwen3", model_config("qwen3_moe", experts=8))
    source = with_model(examples, tmp_path, qwen3)
    code, out, err = run("validate", "-f", str(source))
    assert (code, err) == (0, "")
    assert f"checkpoint {qwen3 / 'config.json'}" in out
    assert (f"{source}: note: spec.sharedExperts.placement: not applicable: qwen3_moe has no shared experts"
            in out)
