import pytest
import torch

from tiercache.layout import BufferSpec, Layout, LayoutError


def hybrid(page_tokens=16, rows=8, dtype="bfloat16", tp_rank=0, tp_size=1):
    return Layout(page_tokens,
                  paged=(BufferSpec("k0", rows, (page_tokens, 2, 64), dtype),
                         BufferSpec("v0", rows, (page_tokens, 2, 64), dtype)),
                  slots=(BufferSpec("ssm0", 4, (8, 16, 16), "float32"),),
                  tp_rank=tp_rank, tp_size=tp_size)


def test_sizes_and_offsets_follow_the_specs():
    layout = hybrid()
    assert layout.paged[0].row_bytes == 16 * 2 * 64 * 2
    assert layout.page_bytes == 2 * 16 * 2 * 64 * 2
    assert layout.checkpoint_bytes == 8 * 16 * 16 * 4
    assert (layout.page_rows, layout.slot_rows) == (8, 4)
    assert layout.needs_pages and layout.needs_checkpoint


def test_fingerprint_is_stable_and_ignores_row_counts():
    assert hybrid().fingerprint == hybrid().fingerprint
    assert hybrid(rows=8).fingerprint == hybrid(rows=1000).fingerprint


@pytest.mark.parametrize("other", [hybrid(page_tokens=32), hybrid(dtype="float16"),
                                   hybrid(tp_rank=1, tp_size=2)])
def test_fingerprint_changes_with_what_makes_bytes_reusable(other):
    assert other.fingerprint != hybrid().fingerprint


def test_layout_of_tensors():
    k = torch.zeros(10, 16, 4, dtype=torch.float16)
    layout = Layout.of(16, paged={"k": k}, slots={"s": torch.zeros(3, 5)})
    assert layout.paged[0] == BufferSpec("k", 10, (16, 4), "float16")
    assert layout.slots[0] == BufferSpec("s", 3, (5,), "float32")


@pytest.mark.parametrize("make, field", [
    (lambda: Layout(0, paged=(BufferSpec("k", 1, (1,), "uint8"),)), "page_tokens"),
    (lambda: Layout(16), "no buffers"),
    (lambda: Layout(16, paged=(BufferSpec("k", 1, (1,), "uint8"),) * 2), "'k' appears twice"),
    (lambda: BufferSpec("k", 0, (1,), "uint8"), "rows"),
    (lambda: BufferSpec("k", 2, (0,), "uint8"), "row_shape"),
    (lambda: BufferSpec("k", 2, (4,), "complex64"), "dtype"),
    (lambda: BufferSpec("", 2, (4,), "uint8"), "name"),
    (lambda: Layout(16, paged=(BufferSpec("k", 2, (1,), "uint8"), BufferSpec("v", 3, (1,), "uint8"))),
     "row counts"),
    (lambda: Layout(16, paged=(BufferSpec("k", 2, (1,), "uint8"),), tp_rank=2, tp_size=2), "tp_rank"),
])
def test_bad_layouts_name_the_bad_field(make, field):
    with pytest.raises(LayoutError, match=field):
        make()
