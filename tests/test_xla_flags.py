"""The GPU training flags (`_bridge/xla_flags.py`): added only on a GPU, before the backend, never over the user's."""

from __future__ import annotations

import pytest

from torchshard._bridge.xla_flags import GPU_FLAGS, gpu_flags_for


@pytest.fixture
def libraries(tmp_path):
    """Two fake XLA libraries (jaxlib's and a CUDA plugin's), 2 MiB each, naming every flag but one."""
    known = [n for n in GPU_FLAGS if n != "xla_gpu_enable_while_loop_double_buffering"]
    paths = []
    for name in ("libjax_common.so", "xla_cuda_plugin.so"):
        path = tmp_path / name
        path.write_bytes(b"\0" * (2 << 20) + " ".join(known).encode())
        paths.append(path)
    return paths


def test_on_a_gpu_before_the_backend_every_flag_the_libraries_know_is_added(libraries):
    flags = gpu_flags_for({}, gpu=True, started=False, libraries=libraries)
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
    assert "--xla_gpu_enable_triton_gemm=false" in flags
    assert not [f for f in flags if "double_buffering" in f]  # unknown to this XLA: it would abort the process
    assert len(flags) == len(GPU_FLAGS) - 1


@pytest.mark.parametrize(
    ("environ", "gpu", "started"),
    [
        ({"XLA_FLAGS": ""}, True, False),  # the user's XLA_FLAGS, even empty, is the whole of it
        ({"XLA_FLAGS": "--xla_dump_to=/tmp/x"}, True, False),
        ({}, False, False),  # no NVIDIA GPU
        ({}, True, True),  # the backend has started: XLA read its flags already
        ({"JAX_PLATFORMS": "cpu"}, True, False),  # JAX told to leave the GPU alone
    ],
    ids=["user-empty", "user-set", "no-gpu", "too-late", "cpu-platform"],
)
def test_nothing_is_added_where_it_must_not_be(libraries, environ, gpu, started):
    assert gpu_flags_for(environ, gpu=gpu, started=started, libraries=libraries) == []


def test_a_library_without_a_flag_keeps_it_out_even_if_another_has_it(libraries, tmp_path):
    other = tmp_path / "older_plugin.so"
    other.write_bytes(b"\0" * (2 << 20) + b"xla_gpu_enable_latency_hiding_scheduler")
    flags = gpu_flags_for({}, gpu=True, started=False, libraries=[*libraries, other])
    assert flags == ["--xla_gpu_enable_latency_hiding_scheduler=true"]


def test_every_flag_says_why():
    assert all(value and why for value, why in GPU_FLAGS.values())
