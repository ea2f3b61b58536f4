"""The work header an FFN rank reads on its host (wire.py): a header it would size a receive or
slice rows by is checked first, and a bad one is refused naming the field and the rule."""

import pytest
import torch

from afd_shared_experts.errors import PayloadError
from afd_shared_experts.wire import KIND_WORK, MAGIC, WireLayout, decode_work_header

LAYOUT = WireLayout(hidden_size=8, dtype=torch.float32, local_experts=2, num_ffn_ranks=2, top_k=2, max_tokens=16,
                    shared="affinity")


def header(tokens: int, rows: int, routed=(3, 2), prefix=(1, 0), extra: int = 0, magic: int | None = None):
    values = LAYOUT.static_header(KIND_WORK, 5, 0, 1, 1)
    if magic is not None:
        values[0] = magic
    return values + [tokens, rows, extra, *routed, *prefix]


def test_a_valid_header_decodes_with_its_token_count():
    work = decode_work_header(header(tokens=3, rows=5), LAYOUT, source=1)
    assert (work.tokens, work.rows, work.routed_counts, work.shared_prefix, work.layer) == (3, 5, (3, 2), (1, 0), 5)


@pytest.mark.parametrize("values,message", [
    (header(tokens=17, rows=5), r"field tokens must be in \[0, 16\] \(got 17\)"),
    (header(tokens=-1, rows=5), r"field tokens must be in \[0, 16\] \(got -1\)"),
    # 2 tokens hold at most min(top_k, local experts) = 2 rows each: 5 rows do not fit the receive.
    (header(tokens=2, rows=5), r"field rows must equal the routed rows plus shared_extra and be at most the "
                               r"capacity 4 of 2 tokens \(got rows 5"),
    (header(tokens=3, rows=4), r"field rows must equal the routed rows plus shared_extra"),
    (header(tokens=3, rows=5, magic=MAGIC - 1), rf"field magic must be {MAGIC} \(got {MAGIC - 1}\)"),
], ids=["tokens-above-budget", "tokens-negative", "rows-above-the-tokens-capacity", "rows-not-the-counts",
        "old-format"])
def test_a_bad_header_is_refused_naming_the_field(values, message):
    with pytest.raises(PayloadError, match=r"work header from Attention rank 1: " + message):
        decode_work_header(values, LAYOUT, source=1)
