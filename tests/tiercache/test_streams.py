"""streams.current: a stream made current for a block, and what was current after it."""

import pytest
import torch

from tiercache.streams import current

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_a_stream_is_current_inside_the_block_and_the_last_one_after_it():
    before = torch.cuda.current_stream()
    side, other = torch.cuda.Stream(), torch.cuda.Stream()
    with current(side):
        assert torch.cuda.current_stream() == side
        with current(other):  # nested, as a staged copy inside a launch's block would be
            assert torch.cuda.current_stream() == other
        assert torch.cuda.current_stream() == side
        x = torch.ones(1 << 20, device="cuda") * 2  # queued on `side`
    assert torch.cuda.current_stream() == before
    side.synchronize()
    assert x.sum().item() == 2 * (1 << 20)


def test_the_stream_is_current_again_after_an_error_inside_the_block():
    before = torch.cuda.current_stream()
    with pytest.raises(RuntimeError, match="inside"):
        with current(torch.cuda.Stream()):
            raise RuntimeError("inside")
    assert torch.cuda.current_stream() == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_stream_of_another_gpu_leaves_the_current_gpu_as_it_was():
    torch.cuda.set_device(0)
    before = torch.cuda.current_stream(0)
    other = torch.cuda.Stream(device=1)
    with current(other):
        assert torch.cuda.current_device() == 1 and torch.cuda.current_stream(1) == other
    assert torch.cuda.current_device() == 0 and torch.cuda.current_stream(0) == before
    assert torch.cuda.current_stream(1) != other
