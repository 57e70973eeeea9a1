"""Triton model `preprocess`: text_input (+ apply_chat_template) -> input_ids [1, L].

Per-request errors (not UTF-8, empty, over `max_input_bytes`, batch size > 1) go back to that
client only. A request without apply_chat_template gets spec_decode's setting of that name.
Tokenization itself lives in eagle_serve.tokenization.
"""
import json

from eagle_serve import triton_utils as tu
from eagle_serve.settings import chat_template_default, tokenizer_dir
from eagle_serve.tokenization import encode_prompt, has_chat_template, load_tokenizer


class TritonPythonModel:
    def initialize(self, args):
        params = tu.model_parameters(json.loads(args["model_config"]))
        folder = tokenizer_dir(params.get("tokenizer_dir", "target"), tu.repository_dir(args))
        self.tokenizer = load_tokenizer(folder)
        self.max_input_bytes = int(params.get("max_input_bytes", 65536))
        self.apply_chat_template = chat_template_default(tu.repository_dir(args))

    def execute(self, requests):
        return tu.respond_each(requests, self.encode)

    def encode(self, request):
        text = tu.text(request, "text_input", required=True, max_bytes=self.max_input_bytes)
        if not text:
            raise tu.RequestError("input 'text_input' is empty")
        use_template = bool(tu.scalar(request, "apply_chat_template", self.apply_chat_template))
        if use_template and not has_chat_template(self.tokenizer):
            raise tu.RequestError("this tokenizer has no chat template: "
                                  "send apply_chat_template=false with a raw prompt")
        ids = encode_prompt(self.tokenizer, text, use_template)
        if not ids:
            raise tu.RequestError("the prompt encodes to no tokens")
        return [tu.ids_tensor("input_ids", ids)]
