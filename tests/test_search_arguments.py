"""``ts.inspect.search``'s bad-input table: counts it cannot search over are one ArgumentError before anything is built.

The command line (``plan --search``) checks its flags itself (tests/test_search.py); the library call
took ``device_memory=0`` as the profile's memory, hosts that do not divide the devices, and
``microbatches=(0,)`` to a ZeroDivisionError.
"""

from __future__ import annotations

import pytest
import torch

import torchshard as ts
from torchshard._base.errors import ArgumentError


def _unbuildable() -> torch.nn.Module:
    raise AssertionError("the model was built before the arguments were checked")


BAD = {
    "zero_device_memory": (dict(device_memory=0), r"device_memory=0 must be an int ≥ 1 or None \(the profile's\)"),
    "hosts_not_dividing": (dict(devices=4, hosts=3), r"hosts=3 does not divide devices=4; give one of \[1, 2, 4\]"),
    "zero_hosts": (dict(hosts=0), r"hosts=0 must be an int ≥ 1"),
    "zero_microbatches": (dict(microbatches=(1, 0)), r"each microbatches=0 must be an int ≥ 1"),
    "no_microbatches": (dict(microbatches=()), r"microbatches=\(\) must be a non-empty sequence of ints"),
    "microbatches_int": (dict(microbatches=4), r"microbatches=4 must be a non-empty sequence"),
    "zero_devices": (dict(devices=0), r"devices=0 must be an int ≥ 1"),
    "every_problem": (dict(device_memory=-1, microbatches=(0,)), r"\(2 problems\)"),
}


@pytest.mark.parametrize("case", BAD)
def test_search_refuses_counts_it_cannot_search_before_building_anything(case):
    kwargs, match = BAD[case]
    with pytest.raises(ArgumentError, match=match):
        ts.inspect.search(_unbuildable, **{"devices": 8, "batch": (8, 16), **kwargs})
