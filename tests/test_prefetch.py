"""prefetch: batches placed ahead in a thread, in order, with errors raised where they belong."""

from __future__ import annotations

import itertools

import numpy as np
import optax
import pytest
import torch
from jax.sharding import PartitionSpec as P

import torchshard as ts
from testsupport.models import MLP


def mse(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def trainer_for(mesh, **kwargs):
    torch.manual_seed(0)
    model = MLP()
    return ts.Trainer(model, mse, optax.sgd(0.1), ts.plan(model, mesh), **kwargs)


def loader(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(16, 32, generator=g), torch.randn(16, 16, generator=g)


def test_prefetched_batches_train_exactly_like_direct_ones(mesh_dm):
    direct, ahead = trainer_for(mesh_dm), trainer_for(mesh_dm)
    expected = [float(direct.step(b)["loss"]) for b in loader(5)]
    got = []
    for batch in ts.prefetch(loader(5), ahead, size=3):
        assert batch[0].sharding.spec == P("data")  # placed before the step sees it
        got.append(float(ahead.step(batch)["loss"]))
    np.testing.assert_array_equal(got, expected)


def test_a_loader_error_is_raised_at_its_batch(mesh_dm):
    def failing():
        yield from loader(2)
        raise OSError("disk gone")

    trainer = trainer_for(mesh_dm)
    seen = []
    with pytest.raises(OSError, match="disk gone"):
        for batch in ts.prefetch(failing(), trainer):
            seen.append(trainer.step(batch))
    assert len(seen) == 2


def test_a_batch_that_does_not_fit_is_raised_in_order(mesh_dm):
    batches = [next(loader(1)), (torch.randn(6, 32), torch.randn(6, 16))]
    stream = ts.prefetch(batches, trainer_for(mesh_dm))
    next(stream)
    with pytest.raises(ts.ShardingError, match=r"batch leaf #0 \(6, 32\).*not divisible by data \(size 4\)"):
        next(stream)


def test_stopping_early_ends_the_thread(mesh_dm):
    stream = ts.prefetch(itertools.repeat(next(loader(1))), trainer_for(mesh_dm), size=2)
    assert len([b for b, _ in zip(stream, range(3), strict=False)]) == 3
    stream.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"size": 0}, r"size=0 must be an int ≥ 1"), ({"trainer": "t"}, r"trainer must be a torchshard\.Trainer")],
)
def test_bad_arguments(mesh_dm, kwargs, match):
    arguments = {"trainer": trainer_for(mesh_dm)} | kwargs
    with pytest.raises(ts.ArgumentError, match=match):
        ts.prefetch(loader(1), **arguments)
