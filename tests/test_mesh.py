"""Simulated CPU devices and Auto-axis meshes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import AxisType

import torchshard
from testsupport.helpers import fresh_process
from torchshard import ShardingError
from torchshard._sharding.mesh import THREADS_PER_DEVICE


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


def _xla_cpu_pool_threads() -> int:
    """Threads of XLA's CPU intra-op pool (named XLAEigen) in this process."""
    tasks = Path("/proc/self/task")
    return sum("XLAEigen" in (task / "comm").read_text() for task in tasks.iterdir())


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_the_cpu_thread_pool_has_threads_for_each_devices_collectives():
    """conftest's use_cpu_devices(8) sized XLA's pool before JAX started: with one thread per device, two collectives
    started in different orders by the devices held every thread and deadlocked (falcon_h1's packed CP ring)."""
    assert _xla_cpu_pool_threads() >= THREADS_PER_DEVICE * jax.device_count()


POOL_ENV = """
import json, os
from pathlib import Path
import jax, torchshard

def after(env, platforms=None):
    for name in ("PJRT_NPROC", "NPROC"):
        os.environ.pop(name, None)
    os.environ.update(env)
    jax.config.update("jax_platforms", platforms)
    torchshard.use_cpu_devices(3)
    return os.environ.get("PJRT_NPROC")

report = {"user_pjrt_nproc": after({"PJRT_NPROC": "5"}), "user_nproc": after({"NPROC": "6"}),
          "no_cpu": after({}, "tpu"), "default": after({})}
jax.devices()  # starts the CPU backend with the last case's environment
report["pool"] = sum("XLAEigen" in (t / "comm").read_text() for t in Path("/proc/self/task").iterdir())
print(json.dumps(report))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in Linux's /proc")
def test_use_cpu_devices_sizes_the_pool_unless_the_user_did():
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "NPROC", "JAX_PLATFORMS")}
    done = subprocess.run([sys.executable, "-c", POOL_ENV], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = max(len(os.sched_getaffinity(0)), THREADS_PER_DEVICE * 3)
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "user_pjrt_nproc": "5",  # kept, and NPROC (XLA's fallback) is not overridden either
        "user_nproc": None,
        "no_cpu": None,  # JAX_PLATFORMS without the CPU: nothing to size
        "default": str(expected),
        "pool": expected,
    }


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
