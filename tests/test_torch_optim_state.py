"""A torch optimizer's state in torch's formats: ``ts.optimizer_state_dict``, ``optimizer.load_state_dict`` before the
Trainer is built, DCP's ``get_optimizer_state_dict`` layout both ways, and ``ts.save``/``ts.load`` with a scheduler
whose state the user saves.

The truth is eager unsharded torch trained without stopping, with the same optimizer and scheduler: a run that
moves between torchshard and eager torch (or stops and resumes) must give its losses (rtol 1e-4, as
tests/test_torch_optim.py), and an exported state must be laid out as eager torch's own ``state_dict()`` at that step.
"""

from __future__ import annotations

import copy

import numpy as np
import optax
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.optim import lr_scheduler

import torchshard as ts
from testsupport.models import BlockStack
from torchshard import ArgumentError, CheckpointError

STEPS, SAVED_AT = 6, 3


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Tanh(), nn.Linear(32, 4))


def mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def data(n: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(n)]


def two_groups(model: nn.Module) -> list[dict]:
    """No weight decay on norms and biases, as PyTorch scripts do."""
    named = list(model.named_parameters())
    return [
        {"params": [p for _, p in named if p.ndim >= 2], "weight_decay": 0.1},
        {"params": [p for _, p in named if p.ndim < 2], "weight_decay": 0.0},
    ]


# every supported optimizer, with the options that add state fields turned on
OPTIMIZERS = {
    "SGD": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, dampening=0.1),
    "Adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, amsgrad=True),
    "AdamW": lambda groups: torch.optim.AdamW(groups, lr=1e-2),
    "Adagrad": lambda groups: torch.optim.Adagrad(groups, lr=0.05, initial_accumulator_value=0.1),
    "RMSprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-3, momentum=0.5, centered=True),
    "Adafactor": lambda groups: torch.optim.Adafactor(groups, lr=1e-2),
}


def warmup(optimizer: torch.optim.Optimizer) -> lr_scheduler.LRScheduler:
    """A chainable scheduler (each lr from the group's last one): it resumes exactly only if the groups' lr does."""
    return lr_scheduler.LinearLR(optimizer, start_factor=0.25, total_iters=4)


def eager(model, optimizer, scheduler, batches) -> list[float]:
    losses = []
    for batch in batches:
        optimizer.zero_grad()
        loss = mse(model, batch)
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    return losses


def trained(trainer, scheduler, batches) -> list[float]:
    losses = []
    for batch in batches:
        losses.append(float(trainer.step(batch)["loss"]))
        scheduler.step()
    return losses


def trainer_on(model, optimizer, **options) -> ts.Trainer:
    plan = ts.plan(model, ts.make_mesh({"data": 4, "model": 2}), ts.presets.fsdp(min_size=64))
    return ts.Trainer(model, mse, optimizer, plan, **options)


def assert_laid_out_as(got: dict, want: dict) -> None:
    """``got`` has ``want``'s layout: the same indices, fields, shapes and dtypes, values to 1e-5, equal groups."""
    assert list(got["state"]) == list(want["state"])
    for index, fields in want["state"].items():
        assert list(got["state"][index]) == list(fields), index
        for field, value in fields.items():
            assert got["state"][index][field].dtype == value.dtype and got["state"][index][field].device.type == "cpu"
            np.testing.assert_allclose(got["state"][index][field], value, rtol=1e-4, atol=1e-6, err_msg=field)
    assert got["param_groups"] == want["param_groups"]


def _marked(names: list[str], quick: set[str]) -> list:
    return [pytest.param(n, marks=() if n in quick else pytest.mark.slow) for n in names]


# --- ts.optimizer_state_dict: torchshard → eager torch ---------------------------------------------------------


@pytest.mark.parametrize("name", _marked(list(OPTIMIZERS), {"SGD"}))
def test_an_exported_state_is_torchs_and_continues_in_eager_torch(name):
    make, batches = OPTIMIZERS[name], data()
    ref = mlp()
    optimizer = make(two_groups(ref))
    scheduler = warmup(optimizer)
    want = eager(ref, optimizer, scheduler, batches[:SAVED_AT])
    eager_state = copy.deepcopy(optimizer.state_dict())
    want += eager(ref, optimizer, scheduler, batches[SAVED_AT:])

    model = mlp()
    optimizer = make(two_groups(model))
    scheduler = warmup(optimizer)
    trainer = trainer_on(model, optimizer)
    got = trained(trainer, scheduler, batches[:SAVED_AT])
    exported = ts.optimizer_state_dict(trainer)
    assert_laid_out_as(exported, eager_state)  # initial_lr, the warmed-up lr and the group numbering included

    resumed = mlp()  # a process without the Trainer: plain torch objects only
    resumed.load_state_dict(ts.to_torch_state_dict(trainer))
    again = make(two_groups(resumed))
    again_scheduler = warmup(again)
    again.load_state_dict(exported)
    again_scheduler.load_state_dict(scheduler.state_dict())
    got += eager(resumed, again, again_scheduler, batches[SAVED_AT:])
    np.testing.assert_allclose(got, want, rtol=1e-4)


def test_before_its_first_step_a_parameter_has_no_state_as_in_torch():
    model = mlp()
    trainer = trainer_on(model, OPTIMIZERS["SGD"](two_groups(model)))
    assert ts.optimizer_state_dict(trainer)["state"] == {}  # a momentum buffer of zeros would not be torch's start
    model = mlp()
    trainer = trainer_on(model, OPTIMIZERS["Adagrad"](two_groups(model)))
    assert torch.equal(ts.optimizer_state_dict(trainer)["state"][0]["sum"], torch.full((32, 16), 0.1))  # from init


# --- optimizer.load_state_dict before the Trainer: eager torch → torchshard ------------------------------------


@pytest.mark.parametrize("name", _marked(list(OPTIMIZERS), {"RMSprop"}))
def test_a_state_loaded_before_the_trainer_is_built_continues_the_eager_run(name):
    make, batches = OPTIMIZERS[name], data()
    ref = mlp()
    optimizer = make(two_groups(ref))
    scheduler = warmup(optimizer)
    eager(ref, optimizer, scheduler, batches[:SAVED_AT])
    model, saved, saved_scheduler = copy.deepcopy(ref), copy.deepcopy(optimizer.state_dict()), scheduler.state_dict()
    want = eager(ref, optimizer, scheduler, batches[SAVED_AT:])

    resumed = make(two_groups(model))
    resumed_scheduler = warmup(resumed)
    resumed.load_state_dict(saved)
    resumed_scheduler.load_state_dict(saved_scheduler)
    trainer = trainer_on(model, resumed)
    np.testing.assert_allclose(trained(trainer, resumed_scheduler, batches[SAVED_AT:]), want, rtol=1e-4)


def _stack_loss(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["scan_layers", "pipeline"])
def test_a_stacked_state_is_exported_per_layer_and_loads_back_into_a_stack(layout, tmp_path):
    """Adafactor keeps per-layer state (factored ``row_var``/``col_var`` and a step per layer) in a stack: exported
    per layer (``optimizer_state_dict`` and ``save_dcp``), and loaded back into a stack (``load_state_dict`` before
    the Trainer, and ``load_dcp``)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 64, (8, 8), generator=g) for _ in range(STEPS)]
    torch.manual_seed(0)
    pristine = BlockStack(depth=2)
    make = lambda m: torch.optim.Adafactor(two_groups(m), lr=1e-2)  # noqa: E731
    ref = copy.deepcopy(pristine)
    optimizer = make(ref)
    want = []
    for batch in batches:
        optimizer.zero_grad()
        loss = _stack_loss(ref, batch)
        loss.backward()
        optimizer.step()
        want.append(loss.item())

    def stacked_trainer(model, optimizer):
        if layout == "pipeline":
            plan = ts.plan(model, ts.make_mesh({"stage": 2, "data": 4}))
            return ts.Trainer(model, _stack_loss, optimizer, plan, pipeline=ts.Pipeline(microbatches=2))
        return ts.Trainer(model, _stack_loss, optimizer, ts.plan(model, ts.make_mesh({"data": 8})), scan_layers=True)

    model = copy.deepcopy(pristine)
    trainer = stacked_trainer(model, make(model))
    got = [float(trainer.step(b)["loss"]) for b in batches[:SAVED_AT]]
    exported = ts.optimizer_state_dict(trainer)
    assert exported["state"][1]["row_var"].shape == (64, 1)  # blocks.0.up.weight [64, 32]: factored per layer
    assert [float(s["step"]) for s in exported["state"].values()] == [SAVED_AT] * len(exported["state"])

    ts.save_dcp(tmp_path, trainer)

    back = copy.deepcopy(pristine)
    back.load_state_dict(ts.to_torch_state_dict(trainer))
    optimizer = make(back)
    optimizer.load_state_dict(exported)
    again = stacked_trainer(back, optimizer)  # a stack's state made of its layers' loaded ones
    np.testing.assert_allclose(got + [float(again.step(b)["loss"]) for b in batches[SAVED_AT:]], want, rtol=1e-4)
    fresh = copy.deepcopy(pristine)
    from_dcp = ts.load_dcp(tmp_path, stacked_trainer(fresh, make(fresh)))
    np.testing.assert_allclose(got + [float(from_dcp.step(b)["loss"]) for b in batches[SAVED_AT:]], want, rtol=1e-4)


# --- refused: a loaded state that does not fit, for every optimizer -------------------------------------------


def _stepped(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """``optimizer``'s state_dict after one step of ``model`` (its state made)."""
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.5)
    optimizer.step()
    return optimizer.state_dict()


class Transposed(nn.Module):
    """mlp()'s parameters in the same order and count, its first weight transposed."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(16, 32))
        self.b = nn.Parameter(torch.zeros(32))
        self.c, self.d = nn.Parameter(torch.zeros(32)), nn.Parameter(torch.zeros(32))
        self.e, self.f = nn.Parameter(torch.zeros(32, 4)), nn.Parameter(torch.zeros(4))


def _loaded(make_saved, make_loaded, source=None, **changed):
    """A builder of ``make_loaded(model)`` holding the state ``make_saved`` made on ``source`` (default mlp()), with
    group 0's options ``changed`` after the load (``load_state_dict`` takes the saved groups' options)."""

    def build(model: nn.Module) -> torch.optim.Optimizer:
        saver = (source or mlp)()
        state = _stepped(make_saved(saver.parameters()), saver)
        optimizer = make_loaded(model.parameters())
        optimizer.load_state_dict(state)
        optimizer.param_groups[0].update(changed)
        return optimizer

    return build


STATE_BAD = {
    "SGD-momentum-gone": (_loaded(lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), torch.optim.SGD, momentum=0),
                          r"optimizer state of 0\.weight \[32, 16\] \(param group 0\): unexpected momentum_buffer; "
                          r"load the state_dict a torch\.optim\.SGD with these options saved"),
    "Adam-amsgrad-added": (_loaded(torch.optim.Adam, torch.optim.Adam, amsgrad=True),
                           r"optimizer state of 0\.weight \[32, 16\] \(param group 0\): missing max_exp_avg_sq"),
    "AdamW-other-shapes": (_loaded(torch.optim.AdamW, torch.optim.AdamW, source=Transposed),
                           r"optimizer state of 0\.weight \[32, 16\] \(param group 0\): exp_avg has shape \[16, 32\], "
                           r"not \[32, 16\]; exp_avg_sq has shape \[16, 32\], not \[32, 16\]"),
    "Adagrad-other-shapes": (_loaded(torch.optim.Adagrad, torch.optim.Adagrad, source=Transposed),
                             r"optimizer state of 0\.weight \[32, 16\] .*: sum has shape \[16, 32\], not \[32, 16\]"),
    "RMSprop-centered-added": (_loaded(torch.optim.RMSprop, torch.optim.RMSprop, centered=True),
                               r"optimizer state of 0\.bias \[32\] \(param group 0\): missing grad_avg"),
    "Adafactor-other-shapes": (_loaded(torch.optim.Adafactor, torch.optim.Adafactor, source=Transposed),
                               r"optimizer state of 0\.weight \[32, 16\] .*: row_var has shape \[16, 1\], not "
                               r"\[32, 1\]; col_var has shape \[1, 32\], not \[1, 16\]"),
    "Adagrad-state-into-RMSprop": (_loaded(torch.optim.Adagrad, torch.optim.RMSprop),
                                   r"0\.weight \[32, 16\] \(param group 0\): missing square_avg; unexpected sum; "
                                   r"load the state_dict a torch\.optim\.RMSprop with these options"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(STATE_BAD))
def test_a_loaded_state_that_does_not_fit_is_refused_before_anything_moves(case):
    build, match = STATE_BAD[case]
    model = mlp()
    with pytest.raises(ArgumentError, match=match):
        trainer_on(model, build(model))
    assert all(type(t) is torch.Tensor for t in model.state_dict().values())


def test_every_problem_of_a_loaded_state_is_named_at_once_with_the_other_arguments():
    model = mlp()
    optimizer = _loaded(torch.optim.AdamW, torch.optim.AdamW, source=Transposed)(model)
    with pytest.raises(
        ArgumentError, match=r"(?s)3 problems.*0\.weight \[32, 16\].*3\.weight \[4, 32\].*max_grad_norm"
    ):
        trainer_on(model, optimizer, max_grad_norm=-1.0)


EXPORT_BAD = {
    "optax": (lambda: trainer_on(mlp(), optax.adamw(1e-3)),
              r"optimizer_state_dict\(\) needs a Trainer built with a torch\.optim optimizer; this one steps an optax "
              r"GradientTransformation.*ts\.save \(ts\.load resumes it\).*ts\.to_torch_state_dict"),
    "a-module": (lambda: mlp(), r"optimizer_state_dict\(\) takes a Trainer built with a torch\.optim optimizer, got "
                                r"Sequential"),
    "a-torch-optimizer": (lambda: torch.optim.AdamW(mlp().parameters()), r"got AdamW"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(EXPORT_BAD))
def test_optimizer_state_dict_of_what_has_no_torch_optimizer_state_is_refused(case):
    make, match = EXPORT_BAD[case]
    with pytest.raises(ArgumentError, match=match):
        ts.optimizer_state_dict(make())


# --- DCP: get_optimizer_state_dict's layout both ways --------------------------------------------------------


def test_save_dcp_writes_torchs_layout_which_dcp_load_and_set_state_dict_resume(tmp_path):
    make, batches = OPTIMIZERS["AdamW"], data()
    ref = mlp()
    optimizer = make(two_groups(ref))
    want = eager(ref, optimizer, warmup(optimizer), batches)
    model = mlp()
    optimizer = make(two_groups(model))
    scheduler = warmup(optimizer)
    trainer = trainer_on(model, optimizer)
    got = trained(trainer, scheduler, batches[:SAVED_AT])
    ts.save_dcp(tmp_path, trainer)

    resumed = mlp()  # torch's side: a model and optimizer of its own, read with DCP's state_dict API
    again = make(two_groups(resumed))
    again_scheduler = warmup(again)
    model_state, optimizer_state = get_state_dict(resumed, again)
    both = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(both, checkpoint_id=tmp_path, no_dist=True)
    set_state_dict(resumed, again, model_state_dict=both["model"], optim_state_dict=both["optimizer"])
    again_scheduler.load_state_dict(scheduler.state_dict())
    assert again.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]  # the groups' values came with it
    got += eager(resumed, again, again_scheduler, batches[SAVED_AT:])
    np.testing.assert_allclose(got, want, rtol=1e-4)


@pytest.mark.parametrize("flatten", [False, True], ids=["nested", "torchtitan-flattened"])
def test_load_dcp_resumes_what_torch_saved_with_get_state_dict(flatten, tmp_path):
    make, batches = OPTIMIZERS["SGD"], data()  # SGD: torch keeps no step, only a momentum buffer
    ref = mlp()
    optimizer = make(two_groups(ref))
    scheduler = warmup(optimizer)
    eager(ref, optimizer, scheduler, batches[:SAVED_AT])
    options = StateDictOptions(flatten_optimizer_state_dict=flatten)  # flattened: param_groups.<name>.<key>
    model_state, optimizer_state = get_state_dict(ref, optimizer, options=options)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp_path, no_dist=True)
    saved_scheduler, saved_lr = scheduler.state_dict(), optimizer.param_groups[1]["lr"]
    want = eager(ref, optimizer, scheduler, batches[SAVED_AT:])

    model = mlp()
    resumed = make(two_groups(model))
    resumed_scheduler = warmup(resumed)  # sets lr to the warm-up's first: the checkpoint's groups replace it
    trainer = ts.load_dcp(tmp_path, trainer_on(model, resumed))
    resumed_scheduler.load_state_dict(saved_scheduler)
    assert resumed.param_groups[1]["lr"] == saved_lr
    np.testing.assert_allclose(trained(trainer, resumed_scheduler, batches[SAVED_AT:]), want, rtol=1e-4)


def _torch_checkpoint(folder, make, model=None, change=None) -> None:
    """dcp.save of get_state_dict(model, optimizer) after one eager step; ``change`` edits the dict first."""
    model = model or mlp()
    optimizer = make(model)
    _stepped(optimizer, model)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    if change is not None:
        change(state)
    dcp.save(state, checkpoint_id=folder, no_dist=True)


DCP_BAD = {
    "AdamW-state-into-SGD": (lambda m: torch.optim.AdamW(two_groups(m)), None,
                             r"(?s)missing optimizer state 0\.weight\.momentum_buffer \(32, 16\).*unexpected optimizer "
                             r"state of 0\.weight \(step, exp_avg, exp_avg_sq\): the Trainer's torch\.optim\.SGD, with "
                             r"its options, keeps none of it"),
    "one-group-into-two": (lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), None,
                           r"(?s)param group 0: the checkpoint's group holds \['0\.weight', '0\.bias', '1\.weight', "
                           r"'1\.bias'\] \.\.\., the Trainer's \['0\.weight', '3\.weight'\]: build the optimizer with "
                           r"the same param groups"),
    "nesterov-on": (lambda m: torch.optim.SGD(two_groups(m), lr=0.05, momentum=0.9, nesterov=True), None,
                    r"param group 0: the checkpoint's nesterov is True, the Trainer's optimizer was built with False"),
    "three-groups": (lambda m: torch.optim.SGD(two_groups(m), lr=0.05, momentum=0.9),
                     lambda s: s["optimizer"]["param_groups"].append({**s["optimizer"]["param_groups"][1],
                                                                     "params": []}),
                     r"the checkpoint has 3 param groups, the Trainer's optimizer 2"),
    "mis-shaped": (lambda m: torch.optim.SGD(two_groups(m), lr=0.05, momentum=0.9),
                   lambda s: s["optimizer"]["state"]["0.bias"].update(momentum_buffer=torch.zeros(3)),
                   r"mis-shaped optimizer\.state\.0\.bias\.momentum_buffer: checkpoint \(3,\), Trainer \(32,\)"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(DCP_BAD))
def test_a_torch_checkpoint_that_does_not_fit_the_trainers_optimizer_changes_nothing(case, tmp_path):
    make, change, match = DCP_BAD[case]
    _torch_checkpoint(tmp_path, make, change=change)
    model = mlp()
    optimizer = OPTIMIZERS["SGD"](two_groups(model))
    trainer = trainer_on(model, optimizer)
    before = ts.optimizer_state_dict(trainer)
    with pytest.raises(CheckpointError, match=match):
        ts.load_dcp(tmp_path, trainer)
    assert trainer.step_count == 0 and ts.optimizer_state_dict(trainer) == before


def test_strict_false_loads_the_weights_and_what_fits_of_the_optimizer(tmp_path):
    _torch_checkpoint(tmp_path, lambda m: torch.optim.AdamW(two_groups(m)))
    model = mlp()
    trainer = trainer_on(model, OPTIMIZERS["SGD"](two_groups(model)))
    ts.load_dcp(tmp_path, trainer, strict=False)
    assert trainer.step_count == 1  # AdamW's step
    assert ts.optimizer_state_dict(trainer)["state"] == {}  # no momentum buffer in it: SGD starts afresh


# --- torchshard's own checkpoints, with the scheduler's state the user keeps -----------------------------------


def test_a_checkpoint_and_the_schedulers_state_resume_as_if_never_stopped(tmp_path):
    make, batches = OPTIMIZERS["AdamW"], data()
    ref = mlp()
    optimizer = make(two_groups(ref))
    want = eager(ref, optimizer, warmup(optimizer), batches)
    model = mlp()
    optimizer = make(two_groups(model))
    scheduler = warmup(optimizer)
    first = trainer_on(model, optimizer)
    got = trained(first, scheduler, batches[:SAVED_AT])
    ts.save(tmp_path / "ckpt", first)
    torch.save(scheduler.state_dict(), tmp_path / "scheduler.pt")  # the user's, as in torch

    model = mlp()
    optimizer = make(two_groups(model))
    scheduler = warmup(optimizer)  # sets the warm-up's first lr: the checkpoint's groups' values replace it
    plan = ts.plan(model, ts.make_mesh({"data": 8}))  # another mesh and plan
    trainer = ts.Trainer(model, mse, optimizer, plan)
    ts.load(tmp_path / "ckpt", trainer)
    scheduler.load_state_dict(torch.load(tmp_path / "scheduler.pt"))
    got += trained(trainer, scheduler, batches[SAVED_AT:])
    np.testing.assert_allclose(got, want, rtol=1e-4)
