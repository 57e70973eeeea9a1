"""Triton model `preprocess`: text_input (+ apply_chat_template) -> input_ids [1, L].

Per-request errors (not UTF-8, empty, over `max_input_bytes`, batch size > 1) go back to that
client only; the checks and the encoding are triton_utils.prompt_ids, which spec_decode's direct
path shares.
"""
import json

from eagle_serve import triton_utils as tu
from eagle_serve.settings import tokenizer_dir
from eagle_serve.tokenization import load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = tu.model_parameters(json.loads(args["model_config"]))
        folder = tokenizer_dir(params.get("tokenizer_dir", "target"), tu.repository_dir(args))
        self.tokenizer = load_tokenizer(folder)
        self.max_input_bytes = int(params.get("max_input_bytes", 65536))

    def execute(self, requests):
        return tu.respond_each(requests, self.encode)

    def encode(self, request):
        ids = tu.prompt_ids(request, self.tokenizer, self.max_input_bytes)
        return [tu.ids_tensor("input_ids", ids)]
