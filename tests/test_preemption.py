"""distributed.preempted in one process: SIGTERM after the first call turns it True for good; bad calls."""

from __future__ import annotations

import os
import signal
import threading

import optax
import pytest
import torch

import torchshard as ts
from torchshard._multihost import preemption as _preemption


@pytest.fixture
def caught(monkeypatch):
    """A fresh preemption state, over a recording SIGTERM handler (instead of the default, which ends pytest)."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _: received.append(signum))
    monkeypatch.setattr(_preemption, "_state", {"installed": False, "agreed": False, "previous": signal.SIG_DFL})
    monkeypatch.setattr(_preemption, "_signalled", threading.Event())
    yield received
    signal.signal(signal.SIGTERM, previous)


def tiny_trainer(mesh) -> ts.Trainer:
    model = torch.nn.Linear(4, 2)
    return ts.Trainer(model, lambda m, b: m(b).square().mean(), optax.sgd(0.1), ts.plan(model, mesh))


def test_sigterm_after_the_first_call_makes_preempted_true_for_good(caught, mesh_fsdp):
    trainer = tiny_trainer(mesh_fsdp)
    assert ts.distributed.preempted(trainer) is False  # installs the handler
    os.kill(os.getpid(), signal.SIGTERM)
    assert ts.distributed.preempted(trainer) is True
    trainer.step(torch.ones(8, 4))
    assert ts.distributed.preempted(trainer) is True
    assert caught == []  # the first SIGTERM was the preemption notice, not passed on


def test_a_second_sigterm_goes_to_the_handler_from_before(caught, mesh_fsdp):
    trainer = tiny_trainer(mesh_fsdp)
    ts.distributed.preempted(trainer)
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # a second one: "stop now"
    assert caught == [signal.SIGTERM]
    assert signal.getsignal(signal.SIGTERM) is not _preemption._on_sigterm


@pytest.mark.parametrize("target", [torch.nn.Linear(4, 2), None, "trainer"])
def test_preempted_takes_a_trainer(target):
    with pytest.raises(ts.ArgumentError, match=rf"trainer must be a torchshard.Trainer, got {type(target).__name__}"):
        ts.distributed.preempted(target)
