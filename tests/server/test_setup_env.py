"""`make setup`, run before every `make serve` and `make test`: once its outputs exist, a
second run checks for them without reading them back."""
import subprocess
import sys

from eagle_serve.server import setup_env


def test_a_second_setup_checks_the_cached_tokenizer_without_importing_transformers_or_xgrammar():
    cached = setup_env.cache_default_tokenizer()  # made now if this machine lacks it
    assert cached.is_file()
    script = ("import sys\nfrom eagle_serve.server import setup_env\n"
              "print(setup_env.cache_default_tokenizer())\n"
              "heavy = sorted({'transformers', 'xgrammar', 'torch'} & set(sys.modules))\n"
              "assert not heavy, heavy\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(cached)


def test_the_conversion_reads_the_gguf_once_and_leaves_the_gguf_package_as_it_was():
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with setup_env.gguf_read_once():
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 3) is not gguf.get_tensor_name_map(arch, 2)
        assert gguf.GGUFReader is not reader
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
