"""End-to-end CPU benchmark with real vLLM 0.23.0: plain vLLM vs AFD placement 'attention'
vs AFD placement 'ffn' (1 Attention rank + 2 FFN server processes) on a tiny DeepSeek-V2, and
placement 'ffn' with the FFN servers' torch expert backend instead of vLLM's kernels.

Run through the repo's environments (the vLLM venv runs the engines, this script does not
import vllm):
    AFD_VLLM_PYTHON="$(scripts/vllm-env.sh)/bin/python" $(scripts/dev-env.sh)/bin/python benchmarks/e2e_cpu.py
All prompts are batched together, so one engine step yields one token per prompt: tokens/s
= prompts x max_tokens / generate time; mean step latency = generate time / max_tokens.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "plugin"))
from vllm_harness import (  # noqa: E402  (the tests' checkpoint writer and process helpers)
    VOCAB,
    afd_block,
    free_port,
    install_testbed_plugin,
    run_driver,
    start_ffn_servers,
    write_vllm_checkpoint,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    args = p.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    install_testbed_plugin()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = write_vllm_checkpoint(root / "model", "deepseek_v2")
        request = {"model": str(model), "prompts": prompts, "max_tokens": args.max_tokens}
        runs = (("plain vLLM", None, "vllm"), ("AFD placement attention", "attention", "vllm"),
                ("AFD placement ffn", "ffn", "vllm"), ("AFD ffn, torch experts", "ffn", "torch"))
        for name, placement, backend in runs:
            if placement is None:
                result = run_driver(request, root, "plain")
            else:
                tag = f"{placement}-{backend}"
                block = afd_block("attention", port=free_port(), placement=placement)
                servers = start_ffn_servers(model, block, root, tag=f"ffn-{tag}",
                                            extra_args=("--expert-backend", backend))
                try:
                    result = run_driver({**request, "additional_config": block}, root, f"afd-{tag}")
                finally:
                    for proc, _ in servers:
                        proc.stop()
            seconds = result["generate_seconds"]
            same = "" if not rows else ("yes" if result["token_ids"] == rows[0][-1] else "NO")
            rows.append((name, args.prompts * args.max_tokens / seconds, 1000 * seconds / args.max_tokens,
                         result["parameter_bytes"][0], same, result["token_ids"]))
    print(f"{args.prompts} prompts x {args.prompt_len} tokens, {args.max_tokens} new tokens each, float32, eager")
    print(f"{'configuration':<26}{'tok/s':>9}{'step ms':>10}{'attn param B':>14}{'ids = plain':>13}")
    for name, tps, step_ms, param_bytes, same, _ in rows:
        print(f"{name:<26}{tps:>9.1f}{step_ms:>10.1f}{param_bytes:>14}{same:>13}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
