"""Load format ``afd`` for Attention engines (``--load-format afd``, rendered by the operator).

vLLM's default safetensors loader, except that no routed-expert weight is read from disk: vLLM
0.23.0's expert-parallel weight filter skips per-expert ``.weight`` tensors before it reads them
(``ep_weight_filter.should_skip_weight``), and an Attention rank owns no routed expert, so its
set of local experts is empty. The experts make up most of a MoE checkpoint's bytes, so this is
most of an Attention pod's start-up I/O. What still arrives (expert scale tensors, the shared
expert under placement 'ffn') is dropped by name in the model wrappers' ``load_weights``.
"""

from __future__ import annotations

from dataclasses import replace

from vllm.config import get_current_vllm_config
from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

from .compat import afd_config_of

LOAD_FORMAT = "afd"


class AFDAttentionModelLoader(DefaultModelLoader):
    def __init__(self, load_config):
        # The default loader reads the format name to pick files: the checkpoint is safetensors.
        super().__init__(replace(load_config, load_format="safetensors"))

    def _init_ep_weight_filter(self, model_config) -> None:
        if afd_config_of(get_current_vllm_config()) is None:
            raise ValueError(f"--load-format {LOAD_FORMAT}: skips every routed expert, so it needs an Attention "
                             "engine with an 'afd' block in --additional-config")
        self.local_expert_ids = set()
