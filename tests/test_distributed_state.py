"""The tensor-parallel group's collectives, with real processes over gloo."""

import socket

import pytest
import torch
import torch.multiprocessing as mp

from dovetail import distributed


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, results):
    torch.manual_seed(rank)
    distributed.init_tensor_parallel(world, rank, "gloo", f"tcp://127.0.0.1:{port}")
    try:
        x = torch.randn(3, 4) + rank
        summed = distributed.all_reduce(x.clone())
        gathered_last = distributed.all_gather(x, dim=-1)
        gathered_first = distributed.all_gather(x, dim=0)
        results[rank] = (x, summed, gathered_last, gathered_first, distributed.tp_rank(), distributed.tp_size())
    finally:
        distributed.destroy_tensor_parallel()


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_local_math(world):
    manager = mp.Manager()
    results = manager.dict()
    mp.start_processes(_rank_main, args=(world, _free_port(), results), nprocs=world, start_method="spawn")
    xs = [results[r][0] for r in range(world)]
    for rank in range(world):
        _, summed, last, first, got_rank, got_size = results[rank]
        assert (got_rank, got_size) == (rank, world)
        torch.testing.assert_close(summed, sum(xs))
        torch.testing.assert_close(last, torch.cat(xs, dim=-1))
        torch.testing.assert_close(first, torch.cat(xs, dim=0))


def test_one_rank_is_the_identity():
    distributed.init_tensor_parallel(1, 0, "gloo", "unused")
    x = torch.randn(2, 5)
    assert distributed.all_reduce(x) is x
    assert distributed.all_gather(x) is x
    assert not distributed.is_initialized() and distributed.tp_size() == 1


def test_rank_outside_the_world_is_refused():
    with pytest.raises(ValueError, match="rank 2 is outside a world of size 2"):
        distributed.init_tensor_parallel(2, 2, "gloo", "unused")
