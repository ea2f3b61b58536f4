"""Stand-in for ``vllm_ascend.ascend_forward_context`` (test only): the signatures of vllm-ascend
0.23.0's ``set_mc2_tokens_capacity``, ``set_mc2_mask`` and ``set_ascend_forward_context``;
each call is recorded with every parameter's value (defaults included)."""

from contextlib import contextmanager

from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context

from vllm_ascend import CALLS


def set_mc2_tokens_capacity(vllm_config, max_num_reqs, uniform_decode_query_len):
    CALLS.append(("set_mc2_tokens_capacity", dict(vllm_config=vllm_config, max_num_reqs=max_num_reqs,
                                                  uniform_decode_query_len=uniform_decode_query_len)))


def set_mc2_mask(vllm_config, device):
    CALLS.append(("set_mc2_mask", dict(vllm_config=vllm_config, device=device)))


@contextmanager
def set_ascend_forward_context(attn_metadata, vllm_config, num_tokens=0, num_tokens_across_dp=None,
                               in_profile_run=False, num_actual_tokens=None,
                               aclgraph_runtime_mode=CUDAGraphMode.NONE, batch_descriptor=None, model_instance=None,
                               is_draft_model=False, skip_compiled=False, max_tokens_across_pcp=0,
                               draft_attn_metadatas=None, has_sinks=False, input_ids=None,
                               eplb_heat_collection_status=False):
    CALLS.append(("set_ascend_forward_context", dict(locals())))
    with set_forward_context(attn_metadata, vllm_config, num_tokens=num_tokens,
                             num_tokens_across_dp=num_tokens_across_dp, cudagraph_runtime_mode=aclgraph_runtime_mode,
                             batch_descriptor=batch_descriptor, skip_compiled=skip_compiled):
        yield
