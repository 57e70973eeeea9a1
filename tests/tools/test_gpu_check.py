"""`make gpu-check` without a GPU: it says so, checks every kernel against its reference
through the interpreter, measures row invariance, and compares plain decoding with the GPU
config's settings on the float64 tiny model, greedy and seeded sampled requests alone and
greedy ones 4 at a time (identical outputs required)."""
from __future__ import annotations

import pytest
import torch

from eagle_serve.tools import gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, run `make gpu-check`")
def test_gpu_check_runs_its_cpu_parts_and_passes(tiny_models, capsys):
    code = gpu_check.main(["--target", str(tiny_models["target"]),
                           "--drafter", str(tiny_models["eagle3"]), "--dtype", "float64",
                           "--num-prompts", "2", "--max-tokens", "8", "--require-identical"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no GPU" in out and "skipped (nothing to compile on CPU)" in out
    assert out.count(" ok") == 9 and "FAIL" not in out
    for case in ("greedy, 1 stream", "temperature 0.7, 1 stream", "greedy, 4 streams"):
        line = next(line for line in out.splitlines() if line.strip().startswith(case))
        assert line.endswith("outputs identical to k=0: 2/2"), line  # coupled sampling too
    assert "attention: 1 query alone vs beside 20 (another tile)" in out
    assert out.rstrip().endswith("gpu-check: passed")


def test_a_kernel_that_disagrees_with_its_reference_fails_the_check(monkeypatch):
    from eagle_serve.kernels import paged_attention as pa

    original = pa.write_kv_triton

    def off_by_one_slot(k, v, k_cache, v_cache, slots):
        original(k, v, k_cache, v_cache, torch.where(slots >= 0, slots + 1, slots))
    monkeypatch.setattr(pa, "write_kv_triton", off_by_one_slot)
    problems = gpu_check.kernel_checks(6, 2, 16, 512, torch.float32, torch.device("cpu"))
    assert problems["write_kv"] is not None
    assert all(v is None for k, v in problems.items() if k != "write_kv")
