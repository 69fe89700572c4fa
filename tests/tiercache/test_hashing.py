import numpy as np
import pytest
import torch

from tiercache.errors import InvalidArgument
from tiercache.hashing import (HASHES, KEY_BYTES, Namespace, distinct_keys, narrow_hash_for_tests,
                               page_chain, page_keys, token_array)

ROOT = Namespace("model", "layout-fp").root()


def test_same_keys_for_list_numpy_and_tensor_of_any_integer_dtype():
    tokens = list(range(1000, 1000 + 64))
    expected = page_keys(tokens, ROOT, 16)
    assert len(expected) == 4 and all(len(k) == KEY_BYTES for k in expected)
    for variant in (np.array(tokens, np.int32), np.array(tokens, np.uint32), np.array(tokens, np.int64),
                    np.array(tokens, np.uint64), torch.tensor(tokens, dtype=torch.int32),
                    torch.tensor(tokens, dtype=torch.int64), tuple(tokens)):
        assert page_keys(variant, ROOT, 16) == expected


def test_changing_one_token_changes_its_page_and_every_later_key():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 150_000, 16 * 8)
    base = page_keys(tokens, ROOT, 16)
    for position in rng.choice(len(tokens), 10, replace=False):
        changed = tokens.copy()
        changed[position] += 1
        keys = page_keys(changed, ROOT, 16)
        page = position // 16
        assert keys[:page] == base[:page]  # earlier pages keep their keys
        assert all(a != b for a, b in zip(keys[page:], base[page:]))  # this page on all differ


def test_keys_differ_across_namespaces():
    tokens = list(range(32))
    roots = [Namespace("model", "fp").root(), Namespace("other-model", "fp").root(),
             Namespace("model", "fp2").root(), Namespace("model", "fp", tenant="t1").root(),
             Namespace("model", "fp", extra=("lora-7",)).root(),
             Namespace("model", "fp", hash_name="blake2b_128").root()]
    assert len(set(roots)) == len(roots)
    first_keys = {page_keys(tokens, root, 16)[0] for root in roots}
    assert len(first_keys) == len(roots)


def test_namespace_fields_cannot_run_into_each_other():
    # ("ab", "c") and ("a", "bc") must not give the same root
    assert Namespace("ab", "c").root() != Namespace("a", "bc").root()


def test_only_full_pages_get_keys():
    assert page_keys(list(range(47)), ROOT, 16) == page_keys(list(range(32)), ROOT, 16)
    assert len(page_keys(list(range(47)), ROOT, 16)) == 2
    assert page_keys(list(range(15)), ROOT, 16) == []
    assert page_keys([], ROOT, 16) == []


def test_blake2b_keys_follow_the_same_rules():
    root = Namespace("m", "fp", hash_name="blake2b_128").root()
    keys = page_keys(list(range(48)), root, 16, "blake2b_128")
    assert len(keys) == 3 and keys != page_keys(list(range(48)), root, 16)


@pytest.mark.parametrize("bad, message", [
    ([-1, 2], r"2\*\*32"), ([2**32], r"2\*\*32"), (np.zeros((2, 16), np.int64), "one-dimensional"),
    (np.array([1.5, 2.0]), "integers")])
def test_bad_tokens_are_refused_with_a_reason(bad, message):
    with pytest.raises(InvalidArgument, match=message):
        token_array(bad)


def test_bad_namespace_and_page_size():
    with pytest.raises(InvalidArgument, match="model_id"):
        Namespace("", "fp")
    with pytest.raises(InvalidArgument, match="hash_name"):
        Namespace("m", "fp", hash_name="md5")
    with pytest.raises(InvalidArgument, match="page_tokens"):
        page_keys([1, 2], ROOT, 0)


def test_a_chain_has_the_page_keys_and_a_check_per_page():
    root = Namespace("m", "fp").root()
    tokens = list(range(16 * 3 + 5))
    chain = page_chain(tokens, root, 16)
    assert chain.keys == page_keys(tokens, root, 16)  # the same keys, full pages only
    assert chain.checks.dtype == np.uint64 and len(chain.checks) == 3
    # the check of a page depends on its tokens: change one, and only that check and the
    # ones after it change
    changed = page_chain(tokens[:20] + [999_999] + tokens[21:], root, 16)
    assert chain.checks[0] == changed.checks[0] and chain.checks[1] != changed.checks[1]


@pytest.mark.parametrize("count, page", [(0, 16), (15, 16), (16, 16), (16 * 300 + 7, 16), (999, 1),
                                         (4096 + 3, 64), (40_000, 20_000)])
def test_keys_and_checks_are_xxh3_of_the_last_key_and_the_pages_tokens(count, page):
    """The chain hashed in C (tiercache/_chain.c) against xxhash itself, page by page."""
    import xxhash
    from tiercache.hashing import _CHECK_SEED
    tokens = np.random.default_rng(count).integers(0, 2**32, count, dtype=np.int64)
    tokens[::97] = 2**32 - 1
    data, step, prev, keys, checks = tokens.astype("<u4").tobytes(), 4 * page, bytes(ROOT), [], []
    for start in range(0, len(data) - step + 1, step):
        checks.append(xxhash.xxh3_64_intdigest(prev + data[start:start + step], _CHECK_SEED))
        prev = xxhash.xxh3_128_digest(prev + data[start:start + step])
        keys.append(prev)
    for given in (tokens.tolist(), tokens, torch.from_numpy(tokens)):
        chain = page_chain(given, ROOT, page)
        assert page_keys(given, ROOT, page) == chain.keys == keys
        assert chain.checks.tolist() == checks and chain.checks.dtype == np.uint64


def test_a_narrowed_hash_keeps_only_its_first_bits():
    name = narrow_hash_for_tests(12)
    key = HASHES[name](b"some page")
    assert key[:1] == HASHES["xxh3_128"](b"some page")[:1] and key[1] & 0x0F == 0
    assert key[2:] == bytes(14)


@pytest.mark.parametrize("count", [2, 300, 1024, 1025, 5000])
@pytest.mark.parametrize("low_bits", [64, 6, 0])  # keys whose low halves tie, as a caller may send
def test_a_repeated_key_is_found_wherever_it_sits(count, low_bits):
    rng = np.random.default_rng(count + low_bits)
    keys = rng.integers(0, 2**63, (count, 2), dtype=np.int64).astype(np.uint64)
    keys[:, 0] &= np.uint64((1 << low_bits) - 1)
    distinct = keys[np.unique(keys, axis=0, return_index=True)[1]]
    keys, count = distinct[rng.permutation(len(distinct))], len(distinct)
    assert distinct_keys(keys) is keys
    for first, repeat in ((0, 1), (0, count - 1), (count // 3, count // 2 + 1)):
        if not first < repeat < count:
            continue
        repeated = keys.copy()
        repeated[repeat] = repeated[first]
        with pytest.raises(InvalidArgument, match=f"key {repeat} repeats key {first} "):
            distinct_keys(repeated)
