"""Engine arguments as vLLM's parser (``FlexibleArgumentParser``, an argparse parser) reads
them: which flag each argument sets, and their values. The operator decides on these (which
flags it owns, the stage rule), so every spelling vLLM accepts is read as the flag it sets."""

from __future__ import annotations

from typing import Iterable, Optional

# Every single-dash option of vLLM 0.23.0's serve parser (but -h) and the flag it sets.
SHORT_FLAGS = {
    "-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size", "-dp": "--data-parallel-size",
    "-dpn": "--data-parallel-rank", "-dpr": "--data-parallel-start-rank", "-dpl": "--data-parallel-size-local",
    "-dpa": "--data-parallel-address", "-dpp": "--data-parallel-rpc-port", "-dpb": "--data-parallel-backend",
    "-dph": "--data-parallel-hybrid-lb", "-dpe": "--data-parallel-external-lb",
    "-dpm": "--data-parallel-multi-port-external-lb", "-dcp": "--decode-context-parallel-size",
    "-pcp": "--prefill-context-parallel-size", "-ep": "--enable-expert-parallel", "-n": "--nnodes",
    "-r": "--node-rank", "-q": "--quantization", "-sc": "--speculative-config", "-asc": "--api-server-count",
    "-cc": "--compilation-config", "-ac": "--attention-config", "-O": "--optimization-level",
}
# The flags the planner reads (the stage rule): a prefix of one is read as it.
PLANNER_FLAGS = ("--worker-cls", "--speculative-config", "--pipeline-parallel-size", "--enable-dbo", "--ubatch-size")


def engine_flag(arg: str) -> Optional[str]:
    """The flag an engine argument sets as vLLM's parser reads it, or None for a value (negative
    numbers included). A long flag: `_` as `-`, its name before a dot (`--additional-config.afd.host`
    sets `--additional-config`) or `=`. A single-dash one, as argparse reads it: an alias
    (`-tp`), a one-letter alias with its value attached (`-qfp8`), or the one alias it is a
    prefix of (`-t`), each as the long flag it stands for."""
    if arg.startswith("--"):
        name = arg[2:].partition("=")[0].partition(".")[0].replace("_", "-")
        return f"--{name}" if name[:1].isalnum() else None  # a bare `--` ends the options
    if not arg.startswith("-") or len(arg) < 2 or arg[1].isdigit() or arg[1] == ".":
        return None
    name = arg.partition("=")[0]
    if name in SHORT_FLAGS:
        return SHORT_FLAGS[name]
    if name[:2] in SHORT_FLAGS:  # one-letter alias, value attached
        return SHORT_FLAGS[name[:2]]
    matches = [alias for alias in SHORT_FLAGS if alias.startswith(name)]
    return SHORT_FLAGS[matches[0]] if len(matches) == 1 else name


def expands_to(flag: str, known: Iterable[str]) -> Optional[str]:
    """The flag of ``known`` that ``flag`` sets: itself, or the first one it is a prefix of (Python's
    argparse, which vLLM's parser is, expands an unambiguous prefix of a long flag)."""
    known = list(known)
    if flag in known:
        return flag
    if flag.startswith("--"):
        return next((name for name in known if name.startswith("--") and name.startswith(flag)), None)
    return None


def flag_values(args: Iterable[str]) -> dict[str, Optional[str]]:
    """Engine arguments by flag (as vLLM reads it: ``engine_flag``, a prefix of a planner flag
    as that flag), the last one given winning as in argparse: `--flag=value`, `--flag value`,
    or a bare `--flag` (None)."""
    args = list(args)
    values: dict[str, Optional[str]] = {}
    for i, arg in enumerate(args):
        name = engine_flag(arg)
        if name is None:
            continue
        flag = expands_to(name, PLANNER_FLAGS) or name
        given, equals, value = arg.partition("=")
        if not equals and not given.startswith("--") and given not in SHORT_FLAGS and given[:2] in SHORT_FLAGS:
            value, equals = given[2:], "="  # a one-letter alias with its value attached (`-qfp8`)
        following = args[i + 1] if i + 1 < len(args) else None
        values.pop(flag, None)  # the last occurrence wins (and is last in the dict)
        values[flag] = value if equals else (following if following is not None and not following.startswith("-")
                                             else None)
    return values
