"""Smoke test of benchmarks/vs_fsdp2.py: tiny sizes, a row with positive times per workload."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from testsupport.helpers import run_benchmark

WORKLOADS = ["MLP FSDP 8", "MLP FSDP×TP 4×2", "Llama FSDP 8", "Llama FSDP×TP 4×2"]


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch.distributed gloo missing")
def test_vs_fsdp2_benchmark_runs():
    stdout = run_benchmark("vs_fsdp2.py", "--tiny")  # here; its 8 torch ranks in a process group of their own
    rows = [line.split("|")[1:-1] for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header, body = [c.strip() for c in rows[0]], [[c.strip() for c in row] for row in rows[1:]]
    assert header[:4] == ["workload", "torchshard s/step", "FSDP2/DTensor s/step", "FSDP2 ÷ torchshard"]
    assert [r[0] for r in body] == WORKLOADS
    for _, ts_s, torch_s, ratio, *memory in body:
        assert float(ts_s) > 0 and float(torch_s) > 0 and float(ratio.rstrip("×")) > 0
        assert len(memory) == 4 and all(float(m) >= 0 for m in memory if m != "—")
