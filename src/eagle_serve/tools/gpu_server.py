"""gpu-check through Triton: the real tritonserver (`make serve`'s binary, without Docker) on a
copy of the model repository that serves the checked target and head, in the GPU
configuration (configs/gpu.pbtxt) on a GPU and the CPU one elsewhere; then plain decoding
against the default through gRPC, prompt groups through both in turn (the order reversed
every other group: eagle_serve.bench.serve.measure) for greedy requests alone, seeded
temperature-0.7 requests alone and greedy requests 4 at a time; or the same on a server already
running (`--url`).
"""
from __future__ import annotations

from pathlib import Path

from eagle_serve import paths
from eagle_serve.bench.serve import measure
from eagle_serve.server.launch import launch
from eagle_serve.triton_backend.repo_config import copy_repository

CASES = (("greedy, 1 stream", 0.0, 1), ("temperature 0.7, 1 stream", 0.7, 1),
         ("greedy, 4 streams", 0.0, 4))  # (name, temperature, requests at a time)


def served_repository(dest: Path, target: str, drafter: str | None, dtype: str) -> Path:
    """A copy of model_repository/ whose configurations (CPU and GPU) serve these models."""
    settings = {"target_model": str(Path(target).resolve()), "dtype": dtype,
                "drafter_model": str(Path(drafter).resolve()) if drafter else "none"}
    return copy_repository(paths.REPO_ROOT / "model_repository", dest, overrides={"spec_decode": settings})


def through_triton(workdir: Path, target: str, drafter: str | None, dtype: str, on_gpu: bool,
                   prompts: list[str], max_tokens: int) -> dict[str, dict]:
    """{case: plain and default tokens/s, tau, outputs equal to plain decoding's} through a
    server started here and stopped at the end (its log: workdir/server.log)."""
    repo = served_repository(Path(workdir) / "repository", target, drafter, dtype)
    server = launch("gpu-check", repo, Path(workdir) / "server.log", "gpu" if on_gpu else None)
    try:
        return {case: r | dict(server_ready_s=round(server.ready_after_s, 1))
                for case, r in through_server(server.grpc_url, prompts, max_tokens).items()}
    finally:
        server.stop()


def through_server(url: str, prompts: list[str], max_tokens: int) -> dict[str, dict]:
    """through_triton's cases on the server at gRPC address `url`."""
    results = {}
    for case, temperature, concurrency in CASES:
        sampling = {"temperature": temperature} if temperature else None
        got = measure(url, prompts, ["0", "default"], max_tokens, "spec_decode", concurrency, sampling)
        plain, default = got["0"], got["default"]
        results[case] = dict(plain=plain["tokens_per_s"], default=default["tokens_per_s"],
                             tau=default["tau"], same=default["same_as_first"], compared=default["compared"])
    return results
