"""Through the real tritonserver, served with --model-config-name=gpu (its instances made CPU
ones to run here): a model that is not a Llama (a tiny random Qwen3, float32) behind a head in
the vLLM speculators format, named in spec_decode's configs/gpu.pbtxt alone (config.pbtxt still
names the default model), serves the same greedy output with and without drafts, and HF's;
every model reads that file, and its input limit holds in preprocess (the ensemble) and on
spec_decode's direct path."""
from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from triton_pool import CHAINS

from eagle_serve import paths
from eagle_serve.client import grpc_generate
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.models.heads import random_head
from eagle_serve.models.target import load_target_config
from eagle_serve.server.launch import launch
from eagle_serve.testing import hf_generate_greedy, make_tiny_target, write_head_layout
from eagle_serve.triton_backend.repo_config import copy_repository, set_parameter

pytestmark = pytest.mark.server

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]


@pytest.fixture(scope="module")
def qwen3_on_gpu_config(triton_server, tmp_path_factory):
    """(the server, the Qwen3 target's folder)"""
    triton_server.stop_idle()  # a server of its own
    root = tmp_path_factory.mktemp("qwen3")
    target = make_tiny_target(root / "tiny-qwen3", "qwen3", dtype=torch.float32,
                              tokenizer_from=paths.default_target_dir())
    head = random_head(load_target_config(target), 3, 8192, d2t=torch.arange(8192), num_layers=2,
                       qk_norm=True, norm_before_residual=True)
    head_dir = write_head_layout(head, root / "speculator.eagle3", "speculators", target)
    repo = copy_repository(paths.REPO_ROOT / "model_repository", root / "repo")
    for config in repo.glob("*/configs/gpu.pbtxt"):
        text = re.sub(r"kind: KIND_GPU gpus: \[ 0 \]", "kind: KIND_CPU", config.read_text())
        if config.parent.parent.name == "spec_decode":
            for key, value in {"target_model": str(target), "drafter_model": str(head_dir), "dtype": "float32",
                               "num_speculative_tokens": "3", "page_size": "8", "num_target_pages": "256",
                               "num_drafter_pages": "256", "max_input_bytes": "1000", **CHAINS}.items():
                text = set_parameter(text, key, value)
        config.write_text(text)
    server = launch("qwen3-on-gpu-config", repo, root / "server.log", model_config_name="gpu")
    try:
        yield server, target
    finally:
        triton_server.retire(server)


def test_every_model_reads_spec_decodes_gpu_config_alone(qwen3_on_gpu_config):
    server, _ = qwen3_on_gpu_config
    log = server.log_path.read_text()
    for model in ("eagle_target", "eagle_drafter"):
        assert f"{model}: settings from {server.repo / 'spec_decode' / 'configs' / 'gpu.pbtxt'}" in log
    for model in ("ensemble", "spec_decode"):  # max_input_bytes, named there alone
        refused = grpc_generate(server.grpc_url, "x" * 1001, model=model, max_tokens=2)
        assert "1001 bytes, more than the limit of 1000" in str(refused.error), model


def test_a_qwen3_target_with_a_speculators_head_serves_hf_greedy_output_with_and_without_drafts(
        qwen3_on_gpu_config):
    server, target = qwen3_on_gpu_config
    tokenizer = AutoTokenizer.from_pretrained(str(target))
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    for prompt in PROMPTS:
        expected = hf_generate_greedy(hf, encode_prompt(tokenizer, prompt), 20)
        outputs = {}
        for k, shape in ((0, {}), (3, {}), (6, dict(draft_topk=2, draft_depth=3))):
            got = grpc_generate(server.grpc_url, prompt, max_tokens=20, stream=True, ignore_eos=True,
                                num_speculative_tokens=k, **shape)
            assert got.error is None
            if k:
                assert got.counters["num_draft_tokens"] > 0
            outputs[k] = got.output_ids
        assert outputs[0] == outputs[3] == outputs[6] == expected
