"""The llama.cpp peer of `eagle-serve bench serve` (bench.peers). llama-cpp-python builds from
source and is not installed by `make setup`: without it the peer is refused with the command
that installs it; with it, it answers on the default target's GGUF file."""
import importlib.util

import pytest

from eagle_serve import paths
from eagle_serve.bench.peers import llama_cpp_peer
from eagle_serve.core.tokenization import load_tokenizer
from eagle_serve.server.setup_env import default_gguf

HAS_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


@pytest.mark.skipif(HAS_LLAMA_CPP, reason="llama-cpp-python is installed")
def test_the_llama_cpp_peer_without_llama_cpp_python_says_how_to_install_it():
    with pytest.raises(SystemExit, match="pip install llama-cpp-python"):
        llama_cpp_peer(default_gguf(), str(paths.default_target_dir()))


@pytest.mark.skipif(not HAS_LLAMA_CPP, reason="llama-cpp-python is not installed (it builds from source)")
def test_the_llama_cpp_peer_answers_as_llama_cpps_own_chat_api_and_repeats_seeded_samples():
    """Greedy: the server's prompt ids give the answer llama.cpp's chat completion gives (the
    GGUF's own template is SmolLM2's); a seeded sample repeats."""
    from llama_cpp import Llama

    folder = str(paths.default_target_dir())
    generate, tokenizer = llama_cpp_peer(default_gguf(), folder), load_tokenizer(folder)
    question = "What is the capital of France?"
    answer = tokenizer.decode(generate(question, max_tokens=16).output_ids)
    own = Llama(model_path=str(default_gguf()), n_ctx=1024, verbose=False).create_chat_completion(
        [{"role": "user", "content": question}], temperature=0, max_tokens=16)
    assert answer and answer == own["choices"][0]["message"]["content"]
    seeded = [generate("Name a colour.", max_tokens=12, temperature=1.0, seed=7, ignore_eos=True).output_ids
              for _ in range(2)]
    assert seeded[0] == seeded[1] and len(seeded[0]) == 12
