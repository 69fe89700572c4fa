"""Namespace roots and chained page keys.

k_0 = root(namespace), k_i = xxh3_128(k_{i-1} || tokens of page i). A key names the whole
prefix up to the end of its page, so two prompts share key k_i iff they share the first
i pages (up to hash collisions) and the namespace. Tokens are hashed as little-endian
uint32, so a list, a numpy array or a torch tensor of any integer dtype give the same keys.

Beside each key, `page_chain` computes a check c_i = xxh3_64(k_{i-1} || tokens of page i)
under a seed of its own: a second, independent hash of the same input. The cache keeps
it with the entry and serves the entry only to a request that brings the same check, so
two prompts whose keys collide (by accident; on purpose, use blake2b_128) still miss.
"""

from __future__ import annotations

import array as pyarray
import functools
import hashlib
import itertools
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, NewType, Sequence

import numpy as np
import xxhash

from tiercache.errors import InvalidArgument
from tiercache import _chain
from tiercache.keymap import _keymap, salts

PageKey = NewType("PageKey", bytes)
"""16 bytes: the digest naming a prefix that ends on a page boundary."""

KEY_BYTES = 16
_TOKEN_DTYPE = np.dtype("<u4")
_ROOT_TAG = b"tiercache/namespace/v1"
_NATIVE_U4 = pyarray.array("I").itemsize == 4 and sys.byteorder == "little"


def _blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


# Name -> digest function of 16 bytes. xxh3 is the default (fast, not collision
# resistant against an adversary); blake2b is for tenants that share a namespace.
HASHES: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "blake2b_128": _blake2b_128,
}
_CHECK_SEED = 0x7463_6b31_6368_6b31  # any constant other than the keys' (unseeded) one


def narrow_hash_for_tests(bits: int, base: str = "xxh3_128") -> str:
    """Register a hash that keeps only the first `bits` bits of `base` (the rest zero), so
    that tests meet key collisions in a few hundred pages; returns its name. Tests and
    collision drills only: no deployment should name it."""
    name = f"{base}-narrow{bits}-test-only"
    whole, extra, digest = bits // 8, bits % 8, HASHES[base]

    def narrow(data: bytes) -> bytes:
        full = digest(data)
        part = bytes([full[whole] & (0xFF00 >> extra) & 0xFF]) if extra else b""
        return (full[:whole] + part).ljust(KEY_BYTES, b"\0")
    HASHES[name] = narrow
    return name


@dataclass(frozen=True)
class Namespace:
    """Everything that must match for cached bytes to be reusable."""

    model_id: str
    layout_fingerprint: str
    tenant: str = ""
    extra: tuple[str, ...] = ()  # LoRA id, multimodal hashes, ...
    hash_name: str = "xxh3_128"

    def __post_init__(self) -> None:
        if not self.model_id:
            raise InvalidArgument("namespace.model_id is empty: name the model the bytes belong to")
        if not self.layout_fingerprint:
            raise InvalidArgument("namespace.layout_fingerprint is empty: use Layout.fingerprint")
        if self.hash_name not in HASHES:
            raise InvalidArgument(
                f"namespace.hash_name {self.hash_name!r} is unknown: use one of {sorted(HASHES)}")

    def root(self) -> PageKey:
        fields = (self.hash_name, self.model_id, self.layout_fingerprint, self.tenant, *self.extra)
        parts = [_ROOT_TAG, struct.pack("<I", len(fields))]
        for field in fields:
            data = field.encode()
            parts += [struct.pack("<I", len(data)), data]
        return PageKey(HASHES[self.hash_name](b"".join(parts)))


def token_array(tokens: Any) -> np.ndarray:
    """Token ids as a contiguous little-endian uint32 array, whatever they came in."""
    if isinstance(tokens, (list, tuple)) and _NATIVE_U4:
        try:  # three times faster than numpy for a list of Python ints, and range-checked
            return np.frombuffer(pyarray.array("I", tokens), _TOKEN_DTYPE)
        except (OverflowError, TypeError):
            pass  # numpy below says what is wrong
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # a torch tensor
        tokens = tokens.detach().cpu().numpy()
    ids = np.asarray(tokens)
    if ids.size == 0:
        return np.empty(0, _TOKEN_DTYPE)
    if ids.ndim != 1:
        raise InvalidArgument(f"tokens must be one-dimensional, got shape {tuple(ids.shape)}")
    if ids.dtype.kind not in "iu":
        raise InvalidArgument(f"tokens must be integers, got dtype {ids.dtype}")
    if int(ids.min()) < 0 or int(ids.max()) > 0xFFFF_FFFF:
        raise InvalidArgument("token ids must lie in [0, 2**32): check the tokenizer output")
    return np.ascontiguousarray(ids, dtype=_TOKEN_DTYPE)


_BLOCK = 512  # pages cut from the token bytes by one struct call


@functools.lru_cache(maxsize=16)
def _block(step: int) -> struct.Struct:
    return struct.Struct(f"{step}s" * _BLOCK)


def _page_bytes(page_tokens: int) -> int:
    if page_tokens <= 0:
        raise InvalidArgument(f"page_tokens must be positive, got {page_tokens}")
    return page_tokens * _TOKEN_DTYPE.itemsize


def _pages(tokens: Any, page_tokens: int) -> Iterable[bytes]:
    """The bytes of every full page of `tokens`, cut by struct in blocks of pages (in C:
    half the time of slicing page by page, which was half of hashing a prompt)."""
    step = _page_bytes(page_tokens)
    data = token_array(tokens).tobytes()
    pages = len(data) // step
    whole = (pages - pages % _BLOCK) * step
    blocks = _block(step).iter_unpack(memoryview(data)[:whole]) if whole else ()
    rest = struct.unpack_from(f"{step}s" * (pages % _BLOCK), data, whole)
    return itertools.chain(itertools.chain.from_iterable(blocks), rest)


def page_keys(tokens: Any, root: PageKey, page_tokens: int,
              hash_name: str = "xxh3_128") -> list[PageKey]:
    """Chained keys of every full page of `tokens`; a partial last page gets none."""
    if hash_name == "xxh3_128":  # the whole chain in C
        step = _page_bytes(page_tokens)
        return _chain.chain(token_array(tokens), step, root, None)[0]
    digest, prev = HASHES[hash_name], bytes(root)  # PageKey is bytes: no wrapping per page
    return [prev := digest(prev + page) for page in _pages(tokens, page_tokens)]


@dataclass(frozen=True)
class Chain:
    """The page keys of a prompt and the check of each page (uint64)."""

    keys: list[PageKey]
    checks: np.ndarray


def page_chain(tokens: Any, root: PageKey, page_tokens: int,
               hash_name: str = "xxh3_128") -> Chain:
    """`page_keys` and, for every page, its check (see the module doc)."""
    if hash_name == "xxh3_128":  # the whole chain in C
        step = _page_bytes(page_tokens)
        keys, checks_bytes = _chain.chain(token_array(tokens), step, root, _CHECK_SEED)
        return Chain(keys, np.frombuffer(checks_bytes, np.uint64))
    digest, check = HASHES[hash_name], xxhash.xxh3_64_intdigest
    keys: list[PageKey] = []
    checks: list[int] = []
    add_key, add_check, prev = keys.append, checks.append, bytes(root)
    for tokens_of_page in _pages(tokens, page_tokens):
        page = prev + tokens_of_page
        add_check(check(page, _CHECK_SEED))
        prev = digest(page)
        add_key(prev)
    return Chain(keys, np.array(checks, np.uint64))


Keys = Sequence[PageKey] | bytes | np.ndarray
"""Keys in any of three forms: a list of PageKey, their concatenation, or uint64 (n, 2)."""


def check_prompt(tokens: Any, keys: Any) -> None:
    """A call names its prompt by tokens or by keys, one of the two."""
    if (tokens is None) == (keys is None):
        raise InvalidArgument("give either tokens or keys")


def key_array(keys: Keys) -> np.ndarray:
    """Keys as a read-only uint64 array of shape (n, 2), each row one 16-byte key."""
    if isinstance(keys, np.ndarray):
        if keys.ndim != 2 or keys.shape[1] != 2 or keys.dtype != np.uint64:
            raise InvalidArgument(f"a key array must be uint64 (n, 2), got {keys.dtype} {keys.shape}")
        return keys
    data = bytes(keys) if isinstance(keys, (bytes, bytearray, memoryview)) else b"".join(keys)
    count = len(data) // KEY_BYTES if isinstance(keys, (bytes, bytearray, memoryview)) else len(keys)
    if len(data) != count * KEY_BYTES:
        raise InvalidArgument(f"keys must be {KEY_BYTES} bytes each: got {len(data)} bytes "
                              f"for {count} keys")
    return np.frombuffer(data, "<u8").reshape(-1, 2)


def key_list(keys: np.ndarray) -> list[PageKey]:
    """The inverse of key_array: one bytes object per key."""
    data = np.ascontiguousarray(keys, "<u8").tobytes()
    return [PageKey(data[i:i + KEY_BYTES]) for i in range(0, len(data), KEY_BYTES)]


def key_hex(key: bytes, width: int = 8) -> str:
    """A short printable form of a key for logs and errors."""
    return key[:width].hex()


_SALTS = salts()  # the repeat check's hash (a table like the key map's)


def distinct_keys(keys: Keys) -> np.ndarray:
    """`key_array(keys)`, refusing a key repeated in the sequence: a prompt's chained keys
    are all distinct, and a repeat would name one entry twice in one request."""
    chain = key_array(keys)
    found = _keymap.first_repeat(np.ascontiguousarray(chain), *_SALTS) if len(chain) > 1 else None
    if found is not None:
        first, repeat = found
        raise InvalidArgument(f"key {repeat} repeats key {first} ({key_hex(chain[first].tobytes())}"
                              "...): a prompt's page keys are all distinct, so hash it with "
                              "tiercache.hashing")
    return chain
