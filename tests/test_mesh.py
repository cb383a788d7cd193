"""Simulated CPU devices and Auto-axis meshes."""

import jax
import pytest
from helpers import fresh_process
from jax.sharding import AxisType

import torchshard
from torchshard import ShardingError


def test_use_cpu_devices_late_with_a_different_count_is_an_error():
    with pytest.raises(ShardingError, match=r"use_cpu_devices\(4\) was called after JAX started its backend with 8"):
        torchshard.use_cpu_devices(4)


def test_use_cpu_devices_late_with_the_same_count_is_a_no_op():
    torchshard.use_cpu_devices(8)
    assert jax.device_count() == 8


@pytest.mark.parametrize("n", [0, -2, 2.0, "8", True, None])
def test_use_cpu_devices_rejects_non_positive_ints(n):
    with pytest.raises(ShardingError, match=r"n must be a positive int"):
        torchshard.use_cpu_devices(n)


@pytest.mark.slow
@pytest.mark.compat
def test_use_cpu_devices_before_the_backend_starts():
    fresh = fresh_process()  # a fresh process: use_cpu_devices(3) right after import torchshard
    assert fresh["returncode"] == 0, fresh["stderr"]
    assert fresh["devices"] == [3, "cpu"]


@pytest.mark.parametrize(
    ("axes", "shape"),
    [
        ({"data": 4, "model": 2}, {"data": 4, "model": 2}),
        ({"data": -1, "model": 2}, {"data": 4, "model": 2}),
        ({"model": 2, "data": -1}, {"model": 2, "data": 4}),
        ({"data": -1}, {"data": 8}),
        ({"data": 8}, {"data": 8}),
        ({"a": 2, "b": -1, "c": 2}, {"a": 2, "b": 2, "c": 2}),
        ({"data": 1, "model": 8}, {"data": 1, "model": 8}),
    ],
)
def test_make_mesh_shapes(axes, shape):
    mesh = torchshard.make_mesh(axes)
    assert dict(mesh.shape) == shape
    assert list(mesh.shape) == list(shape)  # mesh order is the dict's order
    assert mesh.axis_types == (AxisType.Auto,) * len(shape)
    assert mesh.devices.size == 8


def test_make_mesh_with_fewer_devices():
    devices = jax.devices()[:4]
    mesh = torchshard.make_mesh({"data": -1, "model": 2}, devices=devices)
    assert dict(mesh.shape) == {"data": 2, "model": 2}
    assert set(mesh.devices.flat) == set(devices)


@pytest.mark.parametrize(
    ("axes", "match"),
    [
        ({"data": 3}, r"mesh \{'data': 3\} needs 3 devices but 8 are available"),
        ({"data": 4, "model": 4}, r"needs 16 devices but 8 are available.*multiply to 8"),
        ({"data": 3, "model": -1}, r"8 devices cannot be split into axes of size 3 × model"),
        ({"data": 0, "model": 8}, r"(?s)for 8 devices.*axis 'data' has size 0"),
        ({"data": -2, "model": 2}, r"(?s)for 8 devices.*axis 'data' has size -2"),
        ({"data": 2.0, "model": 4}, r"(?s)for 8 devices.*axis 'data' has size 2\.0"),
        ({"data": True, "model": 8}, r"(?s)for 8 devices.*axis 'data' has size True"),
        ({"data": -1, "model": -1}, r"(?s)for 8 devices.*only one axis may be -1, got \['data', 'model'\]"),
    ],
)
def test_make_mesh_bad_sizes(axes, match):
    with pytest.raises(ShardingError, match=match):
        torchshard.make_mesh(axes)


def test_make_mesh_lists_every_bad_size():
    with pytest.raises(ShardingError, match=r"invalid mesh .* for 8 devices") as err:
        torchshard.make_mesh({"data": 0, "model": "2"})
    assert len(err.value.problems) == 2


@pytest.mark.parametrize("axes", [{}, {"": 8}, {1: 8}, [("data", 8)]])
def test_make_mesh_bad_axes(axes):
    with pytest.raises(ShardingError, match=r"axes must be a non-empty dict of axis name → size"):
        torchshard.make_mesh(axes)


@pytest.mark.parametrize(
    ("devices", "match"),
    [
        (lambda d: [d[0]] * 8, r"devices \['cpu:0'\] are listed more than once; each device may appear once"),
        (lambda d: [], r"devices= is empty; pass None for all devices, or a non-empty list"),
        (lambda d: [1, "cpu"], r"(?s)\(2 problems\).*devices\[0\] is a int, not a jax\.Device.*devices\[1\] is a str"),
        (lambda d: "cpu", r"make_mesh\(devices='cpu'\): pass a list of jax devices"),
        (lambda d: (x for x in d), r"make_mesh\(devices=<generator .*>\): pass a list of jax devices"),
    ],
    ids=["device_twice", "no_devices", "not_devices", "string", "generator"],
)
def test_make_mesh_bad_devices(devices, match):
    with pytest.raises(torchshard.ArgumentError, match=match):
        torchshard.make_mesh({"data": 8}, devices=devices(jax.devices()))
