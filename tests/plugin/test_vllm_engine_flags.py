"""The operator-owned engine flags against vLLM 0.23.0's own parser: every spelling that
changes a setting the operator owns is refused by the operator's validation, in one line."""

from __future__ import annotations

import json
import subprocess

from afd_operator.validation import OPERATOR_OWNED_FLAGS, validate_object
from test_validation import with_change
from vllm_harness import HERE, REPO_ROOT, base_env, vllm_python

# What the operator renders for them (a value for each, so a change shows).
OPERATOR_ARGS = ["--tensor-parallel-size", "2", "--data-parallel-size", "2", "--data-parallel-size-local", "2",
                 "--data-parallel-start-rank", "0", "--data-parallel-rank", "0", "--data-parallel-address", "10.0.0.1",
                 "--data-parallel-rpc-port", "13345", "--port", "8000", "--host", "0.0.0.0", "--served-model-name",
                 "m", "--additional-config", '{"afd": {}}', "--max-num-batched-tokens", "4096", "--max-model-len",
                 "4096", "--dtype", "bfloat16", "--quantization", "fp8", "--shutdown-timeout", "30", "--nnodes", "1",
                 "--node-rank", "0", "--data-parallel-backend", "mp"]


def test_every_spelling_vllm_reads_as_an_owned_flag_is_refused(tmp_path):
    owned = [flag for flag in OPERATOR_OWNED_FLAGS if flag != "--model"]  # the positional model: checked apart
    request, result = tmp_path / "request.json", tmp_path / "result.json"
    request.write_text(json.dumps({"flags": owned, "base": OPERATOR_ARGS}))
    run = subprocess.run([vllm_python(), str(HERE / "vllm_flag_spellings_driver.py"), str(request), str(result)],
                         capture_output=True, text=True, env=base_env(), cwd=REPO_ROOT, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    spellings = json.loads(result.read_text())
    changing = [(spelling, changed) for spelling, changed in spellings if changed]
    assert len(changing) > 100, len(changing)  # aliases, prefixes, `_` spellings, attached values, dotted keys
    accepted = []
    for spelling, changed in changing:
        obj, problems = validate_object(with_change("spec.attention.engineArgs", spelling))
        if not any(p.path.startswith("spec.attention.engineArgs") for p in problems):
            accepted.append((spelling, changed))
    assert accepted == []
