"""``flat_range_blocks``: a range of flat (row-major) indices of a tensor as the fewest rectangular
blocks in order, each one contiguous in memory; how a rank saves its distributed-optimizer share of a
parameter without gathering the whole parameter (megamarl.models.dist_checkpoint)."""

from __future__ import annotations

import pytest
import torch

from megamarl.models.dist_checkpoint import flat_range_blocks


def test_a_range_inside_one_row_is_one_block():
    assert flat_range_blocks(7, 10, (4, 6)) == [((1, 1), (1, 3))]


def test_head_full_rows_and_tail():
    # [4, 6] flat 4..21: the rest of row 0, rows 1-2, the first 4 of row 3
    assert flat_range_blocks(4, 22, (4, 6)) == [((0, 4), (1, 2)), ((1, 0), (2, 6)), ((3, 0), (1, 4))]


def test_whole_rows_and_1d():
    assert flat_range_blocks(6, 18, (4, 6)) == [((1, 0), (2, 6))]
    assert flat_range_blocks(0, 24, (4, 6)) == [((0, 0), (4, 6))]
    assert flat_range_blocks(3, 7, (10,)) == [((3,), (4,))]
    assert flat_range_blocks(3, 3, (10,)) == []


def test_3d_blocks_cover_the_range_in_order():
    shape = (3, 4, 5)
    full = torch.arange(60).view(shape)
    blocks = flat_range_blocks(7, 53, shape)
    assert blocks == [
        ((0, 1, 2), (1, 1, 3)),
        ((0, 2, 0), (1, 2, 5)),
        ((1, 0, 0), (1, 4, 5)),
        ((2, 0, 0), (1, 2, 5)),
        ((2, 2, 0), (1, 1, 3)),
    ]
    got = torch.cat(
        [full[tuple(slice(o, o + s) for o, s in zip(off, size))].flatten() for off, size in blocks]
    )
    assert torch.equal(got, torch.arange(7, 53))


@pytest.mark.parametrize("start,stop", [(-1, 3), (4, 3), (0, 25)])
def test_a_range_outside_the_tensor_is_an_error(start, stop):
    with pytest.raises(ValueError, match="flat range"):
        flat_range_blocks(start, stop, (4, 6))
