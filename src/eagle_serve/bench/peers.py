"""The peers `eagle-serve bench serve` runs in its own process, one stream, interleaved with
the server's configs on the same prompts:
- `hf`: Hugging Face `generate` on the target folder (bench.modes.HFRunner), in --hf-dtype;
- `llama.cpp`: llama-cpp-python on a GGUF file (--gguf; default: the default target's, whose
  Q4_1 blocks the server runs exactly in fp32 and llama.cpp on 8-bit activations), on every
  core. It takes the server's prompt ids (its chat template) and stops at its EOS ids, so both
  emit the same kind of answer. llama-cpp-python is not a dependency of this project: `pip install
  llama-cpp-python` builds it from source (about 5 minutes on 2 cores).
Each is `generate(prompt, *, max_tokens, temperature=0, seed=None, ignore_eos=False) -> Generation`.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

from eagle_serve.client import Generation
from eagle_serve.server.setup_env import default_gguf

PEERS = ("hf", "llama.cpp")
LLAMA_CPP_CONTEXT = 4096  # tokens: a held-out prompt and its answer, with room


def hf_peer(folder: str, dtype: str):
    """transformers' generate on the target `folder` in `dtype`."""
    from eagle_serve.bench.modes import HFRunner

    runner = HFRunner(folder, dtype)

    def generate(prompt: str, *, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 **_) -> Generation:
        config = runner.config(max_tokens, temperature, None)
        start = time.perf_counter()
        ids = runner.generate(prompt, config, seed)
        return Generation(output_ids=ids, latency_s=time.perf_counter() - start)
    return generate


def llama_cpp_peer(gguf: str | Path, folder: str):
    """llama.cpp on `gguf`, prompts encoded with the target `folder`'s tokenizer and template."""
    try:
        from llama_cpp import Llama
    except ImportError:
        raise SystemExit("the llama.cpp peer needs llama-cpp-python: pip install llama-cpp-python "
                         "(it builds llama.cpp from source)") from None
    from eagle_serve.core.tokenization import encode_prompt, eos_token_ids, load_tokenizer

    tokenizer, eos = load_tokenizer(folder), set(eos_token_ids(folder))
    threads = os.cpu_count() or 1
    llm = Llama(model_path=str(gguf), n_ctx=LLAMA_CPP_CONTEXT, n_threads=threads,
                n_threads_batch=threads, verbose=False)

    def generate(prompt: str, *, max_tokens: int, temperature: float = 0.0, seed: int | None = None,
                 ignore_eos: bool = False, **_) -> Generation:
        ids = encode_prompt(tokenizer, prompt)
        if seed is not None:
            llm.set_seed(seed)
        out, start = [], time.perf_counter()
        # top_k 1 is greedy; sampled: the whole distribution at `temperature` (min_p and the
        # repeat penalty off, as the server's defaults)
        for token in llm.generate(ids, temp=temperature, top_k=0 if temperature else 1, top_p=1.0,
                                  min_p=0.0, repeat_penalty=1.0):
            if token in eos and not ignore_eos:
                break
            out.append(token)
            if len(out) == max_tokens:
                break
        return Generation(output_ids=out, latency_s=time.perf_counter() - start)
    return generate


def make_peer(name: str, folder: str, hf_dtype: str, gguf: str | Path | None):
    """gguf: llama.cpp's file; None = the default target's."""
    if name == "hf":
        return hf_peer(folder, hf_dtype)
    return llama_cpp_peer(gguf or default_gguf(), folder)
