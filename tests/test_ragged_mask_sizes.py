"""What the ragged-storage integration plan (`kvtrim.storage`, "Masks") relies on in transformers: a cache
layer whose `get_mask_sizes(q)` returns `(q, seen)` makes the model build only this step's `(b, 1, q, q)`
block (or None), and a mask builder registered through `AttentionMaskInterface` receives the 2D padding
mask, whose columns `[kv_offset + kv_length - q, kv_offset + kv_length)` are this step's tokens."""

from __future__ import annotations

import torch
from conftest import tiny_model
from transformers import AttentionInterface, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, prepare_padding_mask, sdpa_mask

NAME = "kvtrim_test_ragged_probe"


class StepOnlyMaskLayer(DynamicLayer):
    """Stores like `DynamicLayer`, but asks the model for a mask over this step's tokens only."""

    def get_mask_sizes(self, query_length: int, *args, **kwargs) -> tuple[int, int]:
        return query_length, self.get_seq_length()


def test_step_only_mask_sizes_give_the_step_block_and_its_padding():
    records = {"builder": [], "attention": []}

    def builder(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                **kwargs):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        step = None if padding is None else padding[:, kv_offset + kv_length - q_length: kv_offset + kv_length]
        records["builder"].append((q_length, kv_length, kv_offset, step))
        return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                         kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask, **kwargs)

    def attention(module, query, key, value, attention_mask, **kwargs):
        if module.layer_idx == 0:
            records["attention"].append(attention_mask)
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)  # output is not the point

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, builder)
    model = tiny_model("llama")
    model.set_attn_implementation(NAME)
    ids = torch.tensor([[0, 0, 5, 6], [7, 8, 9, 10]])
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    cache = DynamicCache()
    cache.layers = [StepOnlyMaskLayer() for _ in range(2)]
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False,
                       pad_token_id=0)
    prompt, *decode = records["builder"]
    assert prompt[:3] == (4, 4, 0) and torch.equal(prompt[3], mask.bool())
    for step, (q, kv_length, kv_offset, valid) in enumerate(decode):
        assert (q, kv_length, kv_offset) == (1, 1, 4 + step)
        assert valid.all()
    block, *rest = records["attention"]
    assert block.shape == (2, 1, 4, 4)
    # the step block: causal, pad rows and columns of sequence 0 hidden; the diagonal is the step's validity
    assert torch.equal(block[:, 0].diagonal(dim1=-2, dim2=-1), mask.bool())
    assert torch.equal(block[1, 0], torch.ones(4, 4).tril().bool())
    assert all(m is None for m in rest)  # unpadded decode steps: no mask at all
