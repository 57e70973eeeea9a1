"""`make gpu-check` without a GPU: it says so, checks every kernel against its reference
through the interpreter, measures row invariance, and compares plain decoding with the GPU
config's settings on the float64 tiny model, greedy and seeded sampled requests alone and
greedy ones 4 at a time (identical outputs required), in process and through the tiny server
(`--url`: the shared one; the server gpu-check starts without it is `launch`'s, as every
server test's)."""
from __future__ import annotations

import json

import pytest
import torch
from triton_pool import tiny_server

from eagle_serve.tools import gpu_check
from eagle_serve.tools.gpu_forward import PATHS
from eagle_serve.tools.gpu_server import CASES


@pytest.mark.server
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU, run `make gpu-check`")
def test_gpu_check_runs_its_cpu_parts_and_passes(triton_server, tiny_models, capsys, tmp_path):
    server = tiny_server(triton_server, tiny_models, "eagle3")
    code = gpu_check.main(["--target", str(tiny_models["target"]),
                           "--drafter", str(tiny_models["eagle3"]), "--dtype", "float64",
                           "--num-prompts", "2", "--max-tokens", "8", "--require-identical",
                           "--url", server.grpc_url, "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "no GPU" in out and "skipped (nothing to compile on CPU)" in out
    assert out.count(" ok") == 12 and "FAIL" not in out
    for case, _, _ in CASES:  # in process, then through Triton
        lines = [line for line in out.splitlines() if line.strip().startswith(case)]
        assert len(lines) == 2 and all(line.endswith("outputs identical to k=0: 2/2") for line in lines), lines
    assert "attention: 1 query alone vs beside 20 (another tile)" in out
    for path in PATHS:  # one path on CPU: the same outputs
        assert "outputs equal to the fused path's: 2/2" in next(line for line in out.splitlines() if path in line)
    assert "n= 64 max |logit difference|" in out and "argmax equal" in out
    assert out.rstrip().endswith("gpu-check: passed")
    results = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(results["forward_paths"]) == set(PATHS) and results["failures"] == 0
    assert set(results["through_triton"]) == {case for case, _, _ in CASES}
    assert (tmp_path / "gpu_check.png").stat().st_size > 0


def test_a_kernel_that_disagrees_with_its_reference_fails_the_check(monkeypatch):
    from eagle_serve.kernels import layer_ops

    original = layer_ops.rope_write_kv_triton

    def off_by_one_slot(q, k, v, cos, sin, k_cache, v_cache, slots):
        return original(q, k, v, cos, sin, k_cache, v_cache, torch.where(slots >= 0, slots + 1, slots))
    monkeypatch.setattr(layer_ops, "rope_write_kv_triton", off_by_one_slot)
    problems = gpu_check.kernel_checks(6, 2, 16, 72, 100, 512, torch.float32, torch.device("cpu"))
    assert problems["rope_write_kv"] is not None
    assert all(v is None for k, v in problems.items() if k != "rope_write_kv")
