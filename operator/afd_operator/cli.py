"""`afdctl`: validate, plan and render AFDDeployment files offline; print the CRD.

Exit codes: 0 success; 1 invalid input (every problem is listed on stderr, one line each,
whatever the file holds); 2 usage error or unreadable file. The cluster's host-access policy
is checked only when `--policy` gives the chart values it runs with.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Optional, TextIO

import yaml

from .api import AFDDeployment
from .checkpoint import check_checkpoint
from .crd import crd_yaml
from .documents import MAX_FILE_BYTES, read_documents
from .planner import Plan, plan
from .policy import UNCHECKED_HOST_ACCESS, ClusterPolicy, PolicyError, load_policy
from .render import render
from .problems import Problem
from .validation import validate_object

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2


@dataclass
class Loaded:
    source: str  # "FILE" or "FILE#N" for multi-document files
    obj: Optional[AFDDeployment]
    problems: list[Problem]


class UsageError(Exception):
    pass


def _read(path: str) -> bytes:
    try:
        if path == "-":
            return sys.stdin.buffer.read(MAX_FILE_BYTES + 1)
        with open(path, "rb") as stream:
            return stream.read(MAX_FILE_BYTES + 1)
    except OSError as err:
        raise UsageError(f"cannot read {path}: {err.strerror}") from err


def load_documents(paths: Iterable[str], policy: ClusterPolicy = UNCHECKED_HOST_ACCESS) -> list[Loaded]:
    """Parse and validate every YAML document of every file (skipping empty documents)."""
    loaded = []
    for path in paths:
        docs, problems = read_documents(_read(path))
        if problems:
            loaded.append(Loaded(path, None, problems))
            continue
        if not docs:
            loaded.append(Loaded(path, None, [Problem("<document>", "no AFDDeployment found")]))
        for i, doc in enumerate(docs):
            source = path if len(docs) == 1 else f"{path}#{i + 1}"
            obj, problems = validate_object(doc, policy)
            loaded.append(Loaded(source, obj, problems))
    return loaded


def _policy(args: argparse.Namespace) -> ClusterPolicy:
    if args.policy is None:
        return UNCHECKED_HOST_ACCESS
    try:
        return load_policy(args.policy)
    except OSError as err:
        raise UsageError(f"cannot read {args.policy}: {err.strerror}") from err
    except PolicyError as err:
        raise UsageError(f"--policy {args.policy}: {err}") from err


def _report(loaded: list[Loaded], err: TextIO) -> bool:
    ok = True
    for item in loaded:
        for p in item.problems:
            ok = False
            print(f"{item.source}: {p}", file=err)
    return ok


def _plan_of(obj: AFDDeployment) -> Plan:
    return plan(obj.spec, obj.metadata.name, obj.metadata.namespace)


def format_plan(p: Plan) -> str:
    lines = [
        f"AFDDeployment {p.namespace}/{p.name}  revision {p.revision}  topology {p.topology}",
        f"  per instance: {p.attention.ranks} Attention ranks in {p.attention.pods} pod(s), "
        f"{p.ffn.ranks} FFN ranks in {p.ffn.pods} pod(s)",
    ]
    header = ("INSTANCE", "POD", "ROLE", "RANKS", "WORLD", "DEVICES", "DP-START", "HEAD", "PORTS")
    rows = []
    for inst in p.instances:
        for pod in inst.pods:
            last = pod.rank_start + pod.ranks - 1
            world_last = pod.world_rank_start + pod.ranks - 1
            rows.append((
                str(inst.index), pod.name, pod.role, f"{pod.rank_start}-{last}",
                f"{pod.world_rank_start}-{world_last}", str(pod.ranks),
                "-" if pod.dp_start_rank is None else str(pod.dp_start_rank),
                "yes" if pod.head else "",
                ",".join(f"{n}={v}" for n, v in pod.ports) or "-",
            ))
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
    for inst in p.instances:
        lines.append(f"  instance {inst.index} endpoints: connector {inst.head_host}:{inst.ports.connector}, "
                     f"DP rpc {inst.head_host}:{inst.ports.dp_rpc}, API port {inst.ports.api}")
    if not p.instances:
        lines.append("  (replicas: 0, no instances)")
    return "\n".join(lines)


def render_stream(objs: list[dict[str, Any]]) -> str:
    return "".join("---\n" + yaml.safe_dump(o, sort_keys=True, width=1000) for o in objs)


def _cmd_validate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    loaded = load_documents(args.filename, _policy(args))
    if not _report(loaded, err):
        return EXIT_INVALID
    # The model's own config.json, where a copy is readable here: what the pods would refuse.
    checked = [(item, check_checkpoint(item.obj.spec)) for item in loaded]
    if not _report([Loaded(item.source, item.obj, report.problems) for item, report in checked], err):
        return EXIT_INVALID
    for item, report in checked:
        against = f"; checkpoint {report.config}" if report.config else ""
        print(f"{item.source}: valid ({item.obj.metadata.namespace}/{item.obj.metadata.name}{against})", file=out)
        for note in report.notes:
            print(f"{item.source}: note: {note}", file=out)
    return EXIT_OK


def _cmd_plan(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    loaded = load_documents(args.filename, _policy(args))
    if not _report(loaded, err):
        return EXIT_INVALID
    print("\n\n".join(format_plan(_plan_of(item.obj)) for item in loaded), file=out)
    return EXIT_OK


def _cmd_render(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    policy = _policy(args)
    loaded = load_documents(args.filename, policy)
    if not _report(loaded, err):
        return EXIT_INVALID
    objs: list[dict[str, Any]] = []
    for item in loaded:
        objs += render(item.obj.spec, _plan_of(item.obj), owner_uid=args.owner_uid, policy=policy)
    out.write(render_stream(objs))
    return EXIT_OK


def _cmd_crd(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    out.write(crd_yaml())
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="afdctl",
        description="Validate, plan and render AFDDeployment resources offline, and print the CRD.",
        epilog="Exit codes: 0 success, 1 invalid input (every problem listed on stderr as "
               "'FILE: field.path: rule'), 2 usage error or unreadable file.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_text: str, func: Any) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(func=func)
        return p

    def policy_flag(p: argparse.ArgumentParser) -> None:
        p.add_argument("--policy", metavar="VALUES",
                       help="the afd-operator chart values (YAML) the cluster runs with: check hostAccess as its "
                            "webhook does and render its networkPolicy (default: host access not checked, the "
                            "chart's default network policy)")

    p = add("validate", "Check AFDDeployment files; list every problem with its field path.", _cmd_validate)
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE",
                   help="YAML file (repeatable; '-' reads stdin; multi-document files allowed)")
    policy_flag(p)
    p = add("plan", "Show the topology plan: instances, pods per role, ranks, devices, DP start "
                    "ranks and endpoints.", _cmd_plan)
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE", help="YAML file")
    policy_flag(p)
    p = add("render", "Print the Kubernetes objects the operator would create, as a YAML stream.", _cmd_render)
    p.add_argument("-f", "--filename", action="append", required=True, metavar="FILE", help="YAML file")
    p.add_argument("--owner-uid", metavar="UID",
                   help="add owner references to this AFDDeployment UID (as the operator does)")
    policy_flag(p)
    add("crd", "Print the AFDDeployment CustomResourceDefinition.", _cmd_crd)
    return parser


def main(argv: Optional[list[str]] = None, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse exits 2 on usage errors, 0 on --help
        return int(exc.code or 0)
    try:
        return args.func(args, out, err)
    except UsageError as exc:
        print(f"afdctl: {exc}", file=err)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
