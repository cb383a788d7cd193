"""Version-gated shims: each gate, its tripwire (the upstream bug is still there), and what the shims leave alone."""

import importlib.metadata
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch._ops
import torchax

from testsupport.helpers import fresh_process
from torchshard._bridge.env import env
from torchshard._bridge.fixes import batch_norm_stats, copy_from_views, removed_aten
from torchshard._bridge.tensors import wrap


@pytest.mark.parametrize(
    ("torchax_version", "torch_lacks", "expected"),
    [
        ("0.0.13", ("prod", "dim_Dimname"), True),
        ("0.0.13", ("cholesky", None), True),  # torch 2.14
        ("0.0.13", ("qr", None), True),  # torch 2.15
        ("0.0.12", ("prod", "dim_Dimname"), True),
        ("0.0.13.dev20250101", ("prod", "dim_Dimname"), True),
        ("0.0.14", ("prod", "dim_Dimname"), False),
        ("0.0.14.dev20261026", ("qr", None), False),
        ("0.1.0", ("prod", "dim_Dimname"), False),
        ("0.0.13", None, False),  # a torch that still has everything torchax names
        (None, ("prod", "dim_Dimname"), False),  # torchax not installed as a distribution
    ],
)
def test_needs_import_shim(monkeypatch, torchax_version, torch_lacks, expected):
    def version(name):
        assert name == "torchax"
        if torchax_version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return torchax_version

    monkeypatch.setattr(importlib.metadata, "version", version)
    monkeypatch.setattr(removed_aten, "_torch_has", lambda op, overload: (op, overload) != torch_lacks)
    assert removed_aten.needs_import_shim() is expected


def test_faked_names_are_exactly_what_this_torch_lacks():
    faked = removed_aten.faked_overloads()
    assert bool(faked) == removed_aten.needs_import_shim()
    assert len(set(faked)) == len(faked)
    for qualname in faked:
        op, _, overload = qualname.removeprefix("aten::").partition(".")
        assert qualname.startswith("aten::"), qualname
        assert not removed_aten._torch_has(op, overload or None), f"{qualname} exists in this torch but was faked"


def test_getattr_is_restored_after_import():
    assert torch._ops.OpOverloadPacket.__getattr__.__qualname__ == "OpOverloadPacket.__getattr__"
    assert torch._ops._OpNamespace.__getattr__.__qualname__ == "_OpNamespace.__getattr__"
    with pytest.raises(AttributeError, match="no overload name 'not_an_overload'"):
        torch.ops.aten.prod.not_an_overload  # noqa: B018
    with pytest.raises(AttributeError, match="not_an_op"):
        torch.ops.aten.not_an_op  # noqa: B018


def test_shim_window_fakes_missing_names_and_restores(monkeypatch):
    monkeypatch.setattr(removed_aten, "_faked", [])
    packet_getattr = torch._ops.OpOverloadPacket.__getattr__
    namespace_getattr = torch._ops._OpNamespace.__getattr__
    with pytest.raises(RuntimeError, match="boom"), removed_aten.placeholder_removed_aten():
        assert isinstance(torch.ops.aten.sum.not_an_overload, removed_aten.MissingOverload)
        op = torch.ops.aten.not_an_op
        assert isinstance(op, removed_aten.MissingOp)
        assert isinstance(op.default, removed_aten.MissingOverload)
        assert torch.ops.aten.sum.default is torch.ops.aten.sum.default  # real ones untouched
        with pytest.raises(AttributeError):
            torch.ops.aten.sum.__not_a_protocol__  # noqa: B018
        raise RuntimeError("boom")
    assert torch._ops.OpOverloadPacket.__getattr__ is packet_getattr
    assert torch._ops._OpNamespace.__getattr__ is namespace_getattr
    assert removed_aten.faked_overloads() == ("aten::sum.not_an_overload", "aten::not_an_op", "aten::not_an_op.default")
    with pytest.raises(AttributeError):
        torch.ops.aten.not_an_op  # noqa: B018


def test_placeholders_raise_when_called():
    placeholder = removed_aten.MissingOverload("aten::prod.dim_Dimname")
    assert not isinstance(placeholder, torch._ops.OperatorBase)
    assert placeholder in {placeholder}  # torchax keeps overloads in dicts and sets
    assert repr(placeholder) == "MissingOverload('aten::prod.dim_Dimname')"
    with pytest.raises(NotImplementedError, match=r"aten::prod\.dim_Dimname was removed"):
        placeholder(torch.ones(2), "x")
    with pytest.raises(NotImplementedError, match=r"aten::qr was removed"):
        removed_aten.MissingOp("aten::qr")(torch.ones(2, 2))


@pytest.mark.slow
@pytest.mark.compat
def test_the_import_shim_gate_agrees_with_this_stack():
    """When this fails, the gate is wrong for the installed pair: torchax imports without the shim
    (google/torchax#101 fixed: delete REMOVED_ATEN and its shim), or fails although the gate says it is not needed."""
    done = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True, timeout=120)
    fails = done.returncode != 0 and "AttributeError" in done.stderr
    assert fails == removed_aten.needs_import_shim(), (removed_aten.REMOVED_ATEN.bug, done.stderr[-2000:])


@pytest.mark.slow
@pytest.mark.compat
def test_eager_torch_optimizers_step_after_import():
    """torch 2.15 asks torchax's "jax" device for a stream in Optimizer.step (pytorch/xla#9730 twin)."""
    fresh = fresh_process()  # a fresh process: Adam, SGD and AdamW step a CPU parameter after import torchshard
    assert fresh["returncode"] == 0 and fresh["optimizers_stepped"], fresh["stderr"][-2000:]


def test_the_batch_norm_gate_agrees_with_this_torchax():
    """When this fails, google/torchax#22 is fixed in the installed torchax: end BATCH_NORM_STATS's gate there."""
    plain = torchax.tensor.Environment()  # torchax's own lowerings, without torchshard's
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    with plain:
        mean = plain.j2t_iso(jnp.zeros(3))
        var = plain.j2t_iso(jnp.ones(3))
        torch.nn.functional.batch_norm(plain.j2t_iso(jnp.asarray(x.numpy())), mean, var, training=True)
    bug = batch_norm_stats.BATCH_NORM_STATS.bug
    drops = float(abs(mean.jax()).max()) == 0.0
    assert drops == batch_norm_stats.needs_batch_norm_fix(), f"the gate is wrong for this torchax ({bug})"


def test_the_copy_from_views_gate_agrees_with_this_torchax():
    """When this fails, torchax's own copy_ reads a view it copies from: end COPY_FROM_VIEWS's gate there."""
    plain = torchax.tensor.Environment()  # torchax's own lowerings, without torchshard's
    with plain:
        source = plain.j2t_iso(jnp.arange(6.0).reshape(2, 3))
        try:
            plain.j2t_iso(jnp.zeros(3)).copy_(source[1])
            fails = False
        except AttributeError:
            fails = True
    assert fails == copy_from_views.COPY_FROM_VIEWS.applies(), copy_from_views.COPY_FROM_VIEWS.bug


def test_batch_norm_fix_updates_running_stats_like_torch():
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    mean, var = torch.zeros(3), torch.ones(3)
    torch.nn.functional.batch_norm(x, mean, var, training=True)
    jmean, jvar = wrap(jnp.zeros(3)), wrap(jnp.ones(3))
    with env():
        torch.nn.functional.batch_norm(wrap(jnp.asarray(x.numpy())), jmean, jvar, training=True)
    torch.testing.assert_close(torch.from_numpy(np.asarray(jmean.jax())), mean)
    torch.testing.assert_close(torch.from_numpy(np.asarray(jvar.jax())), var)
