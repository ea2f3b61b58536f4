"""Engine arguments as vLLM's parser (``FlexibleArgumentParser``, an argparse parser) reads
them: which flag each argument sets, and their values. The operator decides on these (which
flags it owns, the stage rule), so a spelling vLLM accepts is the spelling checked."""

from __future__ import annotations

from typing import Iterable, Optional


def engine_flag(arg: str) -> Optional[str]:
    """The flag an engine argument names as vLLM's parser (FlexibleArgumentParser) reads it: in a
    long flag, `_` as `-` and the name before a dot (`--additional-config.afd.host` sets
    `--additional-config`) or `=`; None for a value (negative numbers included)."""
    if arg.startswith("--") and len(arg) > 2:
        return "--" + arg[2:].partition("=")[0].partition(".")[0].replace("_", "-")
    if arg.startswith("-") and len(arg) > 1 and not arg[1].isdigit() and arg[1] != ".":
        return arg.partition("=")[0]
    return None


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
    """Engine arguments by flag (as vLLM reads it: ``engine_flag``): `--flag=value`, `--flag
    value`, or a bare `--flag` (None)."""
    args = list(args)
    values: dict[str, Optional[str]] = {}
    for i, arg in enumerate(args):
        name = engine_flag(arg)
        if name is None:
            continue
        _, equals, value = arg.partition("=")
        flag = name
        following = args[i + 1] if i + 1 < len(args) else None
        values[flag] = value if equals else (following if following is not None and not following.startswith("-")
                                             else None)
    return values
