"""move_blocks: every path (one run, scattered, per-layer) lands the same bytes."""

from __future__ import annotations

import pytest
import torch

from minimemserve.blocks.copy import check_pool_tensor, is_run, move_blocks
from minimemserve.blocks.layout import PER_LAYER, KVLayout


def test_is_run():
    assert is_run([]) and is_run([7]) and is_run([3, 4, 5])
    assert not is_run([3, 5]) and not is_run([4, 3])


@pytest.mark.parametrize(
    "dst_ids",
    [[2, 3, 4], [6, 1, 4], [5]],
    ids=["run", "scattered", "single"],
)
def test_aggregated_blocks_land_in_place(dst_ids):
    src = torch.randn(8, 2, 2, 4, 1, 3)
    dst = torch.zeros_like(src)
    src_ids = [7, 0, 3][: len(dst_ids)]
    move_blocks(dst, dst_ids, src, src_ids)
    assert torch.equal(dst[dst_ids], src[src_ids])
    untouched = [b for b in range(8) if b not in dst_ids]
    assert not dst[untouched].any()


def test_per_layer_blocks_land_in_place():
    src = torch.randn(2, 2, 8, 4, 1, 3)  # [L, 2, N, ...]
    dst = torch.zeros_like(src)
    move_blocks(dst, [1, 2], src, [5, 6], dim=2)
    assert torch.equal(dst[:, :, [1, 2]], src[:, :, [5, 6]])
    assert not dst[:, :, [0, 3, 4, 5, 6, 7]].any()


def test_bad_arguments():
    src = torch.zeros(4, 1, 2, 2, 1, 1)
    with pytest.raises(ValueError, match="2 source blocks for 1 destination"):
        move_blocks(src.clone(), [0], src, [1, 2])
    with pytest.raises(ValueError, match="dtypes"):
        move_blocks(src.half(), [0], src, [1])


def test_pool_tensor_checks_name_the_problem():
    layout = KVLayout(2, 4, 1, 3)
    check_pool_tensor(layout, torch.float32, torch.zeros(layout.pool_shape(5)), "x")
    with pytest.raises(ValueError, match="recv_copy expects a pool tensor"):
        check_pool_tensor(layout, torch.float32, torch.zeros(5, 2, 2, 4, 1), "recv_copy")
    with pytest.raises(ValueError, match="expects torch.float16"):
        check_pool_tensor(layout, torch.float16, torch.zeros(layout.pool_shape(1)), "x")
    assert layout.block_dim == 0 and KVLayout(2, 4, 1, 3, PER_LAYER).block_dim == 2
