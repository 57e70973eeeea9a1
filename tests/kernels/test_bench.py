"""`python -m eagle_serve.kernels.bench`: skips cleanly without a GPU, and every case it times runs both ways."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle_serve.kernels import bench

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the benchmark")
def test_the_benchmark_skips_cleanly_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "eagle_serve.kernels.bench"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "skipped, no CUDA device" in done.stdout


def test_every_benchmark_case_runs_the_kernel_and_the_reference(capsys):
    calls = []

    def timer(fn):
        calls.append(fn())
        return 1.0

    rows = bench.run("cpu", small=True, timer=timer)
    assert len(rows) == len(calls) // 2 == 13
    assert "paged_attention tree" in capsys.readouterr().out
