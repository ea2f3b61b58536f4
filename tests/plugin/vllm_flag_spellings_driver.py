"""Runs under the vLLM venv: which settings every spelling of some `vllm serve` flags changes,
as vLLM 0.23.0's own parser reads them.

python vllm_flag_spellings_driver.py REQUEST.json RESULT.json
REQUEST: {"flags": [long flags], "base": [the operator's arguments]}
RESULT: [[spelling (a list of arguments), [the flags among "flags" whose value it changed]] ...]
for every spelling of every flag: each option string, `_` for `-`, every unambiguous prefix of a
long one, a one-letter one with its value attached, a dotted key of a JSON one.
"""

import json
import sys


def main() -> None:
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    request = json.load(open(sys.argv[1]))
    parser = make_arg_parser(FlexibleArgumentParser())
    actions = {option: action for action in parser._actions for option in action.option_strings}
    watched = {actions[flag].dest: flag for flag in request["flags"]}
    base = vars(parser.parse_args(["model", *request["base"]]))

    def value_for(action) -> list[str]:
        if action.nargs == 0:
            return []
        return ["7"] if action.type is int else ['{"x": 1}'] if "config" in action.dest else ["other"]

    spellings = []
    for flag in request["flags"]:
        action = actions[flag]
        value = value_for(action)
        for option in action.option_strings:
            if option.startswith("--no-"):
                continue
            spellings.append([option, *value])
            if option.startswith("--"):
                spellings.append([option.replace("-", "_").replace("__", "--", 1), *value])
                spellings += [[option[:end], *value] for end in range(4, len(option))]
                if value:
                    spellings.append([f"{option}={value[0]}"])
            elif len(option) == 2 and value:
                spellings.append([f"{option}{value[0]}"])
        if "config" in action.dest:
            spellings.append([f"{flag}.x=2"])
    results = []
    for spelling in spellings:
        try:
            parsed = vars(parser.parse_args(["model", *request["base"], *spelling]))
        except SystemExit:  # vLLM refuses it (ambiguous prefix, bad value): nothing changes
            continue
        changed = sorted(flag for dest, flag in watched.items() if parsed.get(dest) != base.get(dest))
        results.append([spelling, changed])
    json.dump(results, open(sys.argv[2], "w"))


if __name__ == "__main__":
    main()
