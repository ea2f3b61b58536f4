"""Test-only stand-in for the parts of vllm-ascend 0.23.0 the FFN vLLM backend calls on the Ascend
platform (tests/plugin/test_vllm_ascend_context.py). Each function has the pinned release's
signature and records how it was called in ``CALLS``; the forward context still sets plain vLLM's
context (the first thing the real one does) so vLLM's CPU layers can run inside it."""

# (function name, {parameter: value}) in call order, defaults filled in.
CALLS: list[tuple[str, dict]] = []
