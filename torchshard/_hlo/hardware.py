"""Hardware profiles the plan search estimates step time against: peak FLOP/s, memory and link bandwidths."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from torchshard._base.errors import ArgumentError

GB = 10**9


@dataclasses.dataclass(frozen=True)
class Hardware:
    """One accelerator: what it computes and moves per second, and how many share a fast link domain.

    Attributes:
        name: the profile's name (``--hardware``).
        bf16_flops: dense bf16 matmul peak, FLOP/s per device (no sparsity): MFU is measured against it.
        fp32_flops: the peak of an fp32 step's matmuls (TF32 tensor cores on NVIDIA GPUs, as JAX's default
            matmul precision uses them; bf16 passes on TPUs).
        hbm_bandwidth: device memory bandwidth, bytes/s.
        intra_host_bandwidth: bytes/s one device sends over the fast links (NVLink, TPU ICI), one direction.
        inter_host_bandwidth: bytes/s one device sends to another host (its share of the NICs, or DCN).
        devices_per_host: devices that share the fast links (a GPU host; a TPU ICI slice).
        memory_bytes: device memory (the default ``--device-memory``).
        source: where the figures come from.
    """

    name: str
    bf16_flops: float
    fp32_flops: float
    hbm_bandwidth: float
    intra_host_bandwidth: float
    inter_host_bandwidth: float
    devices_per_host: int
    memory_bytes: int
    source: str

    def peak_flops(self, precision: str) -> float:
        """The matmul peak for a step in ``precision`` (``"bf16"``/``"fp16"`` or ``"fp32"``)."""
        return self.fp32_flops if precision == "fp32" else self.bf16_flops


# Dense (no 2:4 sparsity) peaks from the vendors' datasheets; one direction of each link.
PROFILES: dict[str, Hardware] = {
    h.name: h
    for h in (
        Hardware("h100", 989e12, 494e12, 3.35e12, 450 * GB, 50 * GB, 8, 80 * 2**30,
                 "NVIDIA H100 SXM5 80GB datasheet: 989 TFLOP/s bf16 and 494 TF32 dense, 3.35 TB/s HBM3, NVLink 4 "
                 "900 GB/s bidirectional; one 400 Gb/s NIC per GPU between hosts (DGX H100)"),
        Hardware("h200", 989e12, 494e12, 4.8e12, 450 * GB, 50 * GB, 8, 141 * GB,
                 "NVIDIA H200 SXM 141GB datasheet: 989 TFLOP/s bf16 and 494 TF32 dense (the H100's), 4.8 TB/s HBM3e, "
                 "NVLink 4 900 GB/s bidirectional; one 400 Gb/s NIC per GPU between hosts (DGX H200)"),
        Hardware("a100", 312e12, 156e12, 2.039e12, 300 * GB, 25 * GB, 8, 80 * 2**30,
                 "NVIDIA A100 SXM4 80GB datasheet: 312 TFLOP/s bf16 and 156 TF32 dense, 2.039 TB/s HBM2e, NVLink 3 "
                 "600 GB/s bidirectional; one 200 Gb/s HDR NIC per GPU between hosts (DGX A100)"),
        Hardware("tpu-v5p", 459e12, 459e12 / 3, 2.765e12, 200 * GB, 6.25 * GB, 8960, 95 * GB,
                 "Google Cloud TPU v5p docs: 459 TFLOP/s bf16, 2,765 GB/s HBM, 95 GB HBM, ICI 4,800 Gbps per chip "
                 "(3-D torus: 1,600 Gbps = 200 GB/s per axis), pods of 8,960 chips; fp32 = 3 bf16 passes; "
                 "between slices DCN, 6.25 GB/s per chip assumed"),
        Hardware("tpu-v5e", 197e12, 197e12 / 3, 819 * GB, 100 * GB, 6.25 * GB, 256, 16 * GB,
                 "Google Cloud TPU v5e docs: 197 TFLOP/s bf16, 819 GB/s HBM, 16 GB HBM, ICI 1,600 Gbps per chip "
                 "(2-D torus: 800 Gbps = 100 GB/s per axis), pods of 256 chips; fp32 = 3 bf16 passes; between "
                 "slices DCN, 6.25 GB/s per chip assumed"),
    )
}  # fmt: skip
_ALIASES = {"v5p": "tpu-v5p", "v5e": "tpu-v5e", "tpuv5p": "tpu-v5p", "tpuv5e": "tpu-v5e"}
# what jax's device_kind says ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "TPU v5 lite"), lowercased,
# without spaces and dashes → profile; the first match wins
_DEVICE_KINDS = (("h100", "h100"), ("h200", "h200"), ("a100", "a100"), ("tpuv5p", "tpu-v5p"),
                 ("tpuv5lite", "tpu-v5e"), ("tpuv5e", "tpu-v5e"))  # fmt: skip


def load_profiles(path: str | Path) -> dict[str, Hardware]:
    """Profiles from a JSON file: a list of objects with `Hardware`'s fields (``source`` may be left out).

    Raises:
        ArgumentError: the file is not such a list, naming each bad entry and the fields expected.
    """
    try:
        rows = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ArgumentError(f"--hardware-file {str(path)!r}: {err}") from err
    fields = [f.name for f in dataclasses.fields(Hardware)]
    if not isinstance(rows, list):
        rows = [rows]
    found, problems = {}, []
    for i, row in enumerate(rows):
        try:
            found[row["name"]] = _profile(row)
        except (KeyError, TypeError, ValueError) as err:
            problems.append(f"entry {i}: {err!r}")
    if problems:
        raise ArgumentError(f"--hardware-file {str(path)!r}: {'; '.join(problems)}; each entry needs {fields}")
    return found


def _profile(row: Mapping[str, Any]) -> Hardware:
    numbers = {
        f.name: (int if f.type in ("int", int) else float)(row[f.name])
        for f in dataclasses.fields(Hardware)
        if f.name not in ("name", "source")
    }
    return Hardware(name=str(row["name"]), source=str(row.get("source", "user file")), **numbers)  # type: ignore[arg-type]


def hardware(name: str | Hardware, *, extra: Mapping[str, Hardware] | None = None) -> Hardware:
    """The profile named ``name`` (``h100``, ``h200``, ``a100``, ``tpu-v5p``, ``tpu-v5e``, or one of ``extra``).

    Raises:
        ArgumentError: an unknown name, listing the known ones and the nearest.

    Examples:
        >>> hardware("h100").devices_per_host, hardware("v5e").name
        (8, 'tpu-v5e')
    """
    if isinstance(name, Hardware):
        return name
    known = dict(PROFILES) | dict(extra or {})
    key = _ALIASES.get(name.lower(), name.lower())
    if key in known:
        return known[key]
    near = difflib.get_close_matches(key, list(known), n=2, cutoff=0.4)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    raise ArgumentError(
        f"unknown hardware {name!r}: the known profiles are {sorted(known)}{hint} (add your own with "
        f"--hardware-file FILE.json)"
    )


def for_device_kind(kind: str) -> Hardware | None:
    """The profile of a device as jax names it (``device.device_kind``), or None (CPUs, unknown chips).

    Examples:
        >>> for_device_kind("NVIDIA H100 80GB HBM3").name, for_device_kind("TPU v5 lite").name, for_device_kind("cpu")
        ('h100', 'tpu-v5e', None)
    """
    key = kind.lower().replace(" ", "").replace("-", "")
    return next((PROFILES[name] for part, name in _DEVICE_KINDS if part in key), None)
