import dataclasses

import numpy as np
import pytest

from tiercache.errors import InvalidArgument
from tiercache.flops import ModelShape, page_flops, prefix_flops, saved_flops
from tiercache.layout import Layout
from tests.tiercache.test_layout import hybrid

# one attention layer (2 heads of 4, 1 KV head), one gated MLP of 8, one SSM layer
TINY = ModelShape("tiny", hidden_size=8, attention_layers=1, num_heads=2, num_kv_heads=1,
                  head_dim=4, mlp_layers=1, intermediate_size=8, ssm_layers=1, ssm_heads=2,
                  ssm_head_dim=4, ssm_state_size=3, ssm_groups=1)


def test_per_token_flops_add_up_by_hand():
    # attention: Q (8x8) and O (8x8) = 2*64*2, K and V (8x4 each) = 2*32*2
    attention = 2 * 8 * 8 * 2 + 2 * 8 * 4 * 2
    mlp = 2 * 3 * 8 * 8  # gate, up, down
    # SSM: in-projection to z, x (8 each), B, C (3 each), dt (2) = 24 wide; out 8x8;
    # recurrence 6 * inner 8 * state 3
    ssm = 2 * 8 * 24 + 2 * 8 * 8 + 6 * 8 * 3
    assert TINY.token_flops == attention + mlp + ssm == 1424
    assert TINY.attention_flops == 4 * 2 * 4 == 32  # per (token, earlier token) pair


def test_prefix_flops_are_quadratic_only_through_attention():
    # F(T) = 1424 T + 32 T (T + 1) / 2
    assert prefix_flops(TINY, 1) == 1424 + 32
    assert prefix_flops(TINY, 10) == 14240 + 32 * 55
    no_attention = dataclasses.replace(TINY, attention_layers=0, num_heads=0, num_kv_heads=0,
                                       head_dim=0)
    assert prefix_flops(no_attention, 10) == 10 * prefix_flops(no_attention, 1)


def test_page_flops_grow_with_position_and_sum_to_the_prefix():
    pages = np.arange(1, 9)
    each = page_flops(TINY, 16, pages)
    # later pages attend to more tokens: strictly more expensive
    assert np.all(np.diff(each) > 0)
    # page i = F(16 i) - F(16 (i - 1)); the first page is F(16)
    assert each[0] == prefix_flops(TINY, 16)
    assert each[4] == prefix_flops(TINY, 80) - prefix_flops(TINY, 64)
    assert np.isclose(each.sum(), prefix_flops(TINY, 128))


def test_saved_flops_split_over_tensor_parallel_ranks_and_fall_back_to_tokens():
    assert saved_flops(TINY, 16, 3, tp_size=2) == prefix_flops(TINY, 48) / 2
    # no model shape: a hit is worth its tokens
    assert list(saved_flops(None, 16, np.array([1, 3]))) == [16, 48]


@pytest.mark.parametrize("change, message", [
    (dict(name=""), "name"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(head_dim=-1), "head_dim must be a non-negative integer"),
    (dict(head_dim=0), "attention_layers is 1 but head_dim is 0"),
    (dict(ssm_state_size=0), "ssm_layers is 1 but ssm_state_size is 0"),
    (dict(num_heads=3, num_kv_heads=2), "not a multiple of num_kv_heads"),
    (dict(intermediate_size=2.5), "intermediate_size"),
])
def test_bad_shapes_are_refused_with_the_field_named(change, message):
    with pytest.raises(InvalidArgument, match=message):
        dataclasses.replace(TINY, **change)


def test_the_model_shape_rides_on_the_layout_but_not_in_its_fingerprint():
    plain = hybrid()
    shaped = Layout(plain.page_tokens, plain.paged, plain.slots, model=TINY)
    assert shaped.model is TINY and plain.model is None
    # the bytes are reusable whatever the worker says the model costs
    assert shaped.fingerprint == plain.fingerprint and shaped == plain
