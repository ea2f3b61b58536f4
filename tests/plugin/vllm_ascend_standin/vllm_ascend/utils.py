"""Stand-in for ``vllm_ascend.utils`` (test only): records ``register_ascend_customop``."""

from vllm_ascend import CALLS


def register_ascend_customop(vllm_config=None):
    CALLS.append(("register_ascend_customop", {"vllm_config": vllm_config}))
