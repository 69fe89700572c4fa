import numpy as np
import pytest

from tiercache import tenancy


@pytest.mark.parametrize("count", [0, 1, 3, 2048])
def test_a_mask_is_xored_into_both_halves_of_every_key_and_undone_by_itself(count):
    mask = tenancy.namespace_mask(b"s" * 32, b"some namespace root")
    keys = np.random.default_rng(count).integers(0, 2**63, (count, 4), dtype=np.uint64)[:, ::2]
    engine = tenancy.masked(keys, mask)  # from a strided view, as much as from an array
    assert engine.shape == (count, 2) and engine.dtype == np.uint64
    assert engine.tolist() == [[lo ^ int(mask[0]), hi ^ int(mask[1])] for lo, hi in keys.tolist()]
    assert np.array_equal(tenancy.masked(engine, mask), keys)
