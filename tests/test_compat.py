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

from torchshard._bridge.env import env
from torchshard._bridge.fixes import batch_norm_stats, named_overloads
from torchshard._bridge.tensors import wrap


def test_shim_is_needed_on_this_torch_torchax_pair():
    assert not hasattr(torch.ops.aten.prod, "dim_Dimname")
    assert named_overloads.needs_named_overload_shim()


@pytest.mark.parametrize(
    ("torchax_version", "torch_has_named", "expected"),
    [
        ("0.0.13", False, True),
        ("0.0.12", False, True),
        ("0.0.13.dev20250101", False, True),
        ("0.0.14", False, False),
        ("0.1.0", False, False),
        ("0.0.13", True, False),
        (None, False, False),  # torchax not installed as a distribution
    ],
)
def test_needs_named_overload_shim(monkeypatch, torchax_version, torch_has_named, expected):
    def version(name):
        assert name == "torchax"
        if torchax_version is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return torchax_version

    monkeypatch.setattr(importlib.metadata, "version", version)
    if torch_has_named:
        monkeypatch.setattr(torch.ops.aten.prod, "dim_Dimname", torch.ops.aten.prod.default, raising=False)
    assert named_overloads.needs_named_overload_shim() is expected


def test_faked_overloads_are_only_named_tensor_overloads():
    faked = named_overloads.faked_overloads()
    assert "aten::prod.dim_Dimname" in faked
    assert len(set(faked)) == len(faked)
    for qualname in faked:
        assert qualname.startswith("aten::"), qualname
        assert "dimname" in qualname.lower() or "names" in qualname.lower(), qualname


def test_getattr_is_restored_after_import():
    assert torch._ops.OpOverloadPacket.__getattr__.__qualname__ == "OpOverloadPacket.__getattr__"
    with pytest.raises(AttributeError, match="no overload name 'dim_Dimname'"):
        torch.ops.aten.prod.dim_Dimname  # noqa: B018


def test_shim_window_fakes_only_named_overloads_and_restores(monkeypatch):
    monkeypatch.setattr(named_overloads, "_faked", [])
    original = torch._ops.OpOverloadPacket.__getattr__
    with pytest.raises(RuntimeError, match="boom"), named_overloads.placeholder_named_overloads():
        placeholder = torch.ops.aten.sum.dim_Dimname
        assert isinstance(placeholder, named_overloads.MissingOverload)
        with pytest.raises(AttributeError):
            torch.ops.aten.sum.not_an_overload  # noqa: B018
        raise RuntimeError("boom")
    assert torch._ops.OpOverloadPacket.__getattr__ is original
    assert named_overloads.faked_overloads() == ("aten::sum.dim_Dimname",)
    with pytest.raises(AttributeError):
        torch.ops.aten.sum.dim_Dimname  # noqa: B018


def test_missing_overload_raises_when_called():
    placeholder = named_overloads.MissingOverload("aten::prod.dim_Dimname")
    assert not isinstance(placeholder, torch._ops.OperatorBase)
    assert placeholder in {placeholder}  # torchax keeps overloads in dicts and sets
    assert repr(placeholder) == "MissingOverload('aten::prod.dim_Dimname')"
    with pytest.raises(NotImplementedError, match=r"aten::prod\.dim_Dimname was removed"):
        placeholder(torch.ones(2), "x")


def test_tripwire_torchax_still_needs_the_named_overload_shim():
    """When this fails, google/torchax#101 is fixed in the pinned torchax: delete NAMED_OVERLOADS and its shim."""
    done = subprocess.run([sys.executable, "-c", "import torchax"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "dim_Dimname" in done.stderr, (
        f"torchax now imports without the shim ({named_overloads.NAMED_OVERLOADS.bug}); remove it"
    )


def test_tripwire_torchax_batch_norm_still_drops_running_stats():
    """When this fails, google/torchax#22 is fixed in the pinned torchax: delete BATCH_NORM_STATS and its fix."""
    plain = torchax.tensor.Environment()  # torchax's own lowerings, without torchshard's
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    with plain:
        mean = plain.j2t_iso(jnp.zeros(3))
        var = plain.j2t_iso(jnp.ones(3))
        torch.nn.functional.batch_norm(plain.j2t_iso(jnp.asarray(x.numpy())), mean, var, training=True)
    bug = batch_norm_stats.BATCH_NORM_STATS.bug
    assert float(abs(mean.jax()).max()) == 0.0, f"torchax now updates running stats ({bug})"
    assert batch_norm_stats.needs_batch_norm_fix()


def test_batch_norm_fix_updates_running_stats_like_torch():
    x = torch.randn(8, 3, generator=torch.Generator().manual_seed(0))
    mean, var = torch.zeros(3), torch.ones(3)
    torch.nn.functional.batch_norm(x, mean, var, training=True)
    jmean, jvar = wrap(jnp.zeros(3)), wrap(jnp.ones(3))
    with env():
        torch.nn.functional.batch_norm(wrap(jnp.asarray(x.numpy())), jmean, jvar, training=True)
    torch.testing.assert_close(torch.from_numpy(np.asarray(jmean.jax())), mean)
    torch.testing.assert_close(torch.from_numpy(np.asarray(jvar.jax())), var)
