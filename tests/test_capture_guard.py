"""The CPU capture guard fails the writes a CUDA graph capture refuses (tercel/graphs/capture_guard.py)."""
import pytest
import torch

from tercel.graphs.capture_guard import CaptureGuard


@pytest.mark.parametrize("write", [
    lambda t, i: t.__setitem__((slice(None), i, i), True),  # a scalar through an index tensor
    lambda t, i: t.__setitem__(t > 0, 0),  # a scalar through a mask
])
def test_scalar_writes_through_index_tensors_fail(write):
    t, i = torch.zeros(2, 4, 4, dtype=torch.bool), torch.arange(2)
    with CaptureGuard(), pytest.raises(RuntimeError, match="Python scalar through an index tensor"):
        write(t, i)


def test_slice_fill_and_tensor_writes_pass():
    t, i = torch.zeros(2, 4, 4), torch.arange(2)
    with CaptureGuard():
        t[:, 0] = 1.0
        t[:, 0:2, 0:2].diagonal(dim1=1, dim2=2).fill_(2.0)
        t[:, i, i] = torch.full((2, 2), 3.0)
    assert t[0, 0, 0] == 3.0 and t[0, 1, 1] == 3.0 and t[0, 0, 3] == 1.0
