"""Triton model `preprocess`: text_input (+ apply_chat_template) -> input_ids [1, L].

Per-request errors (not UTF-8, empty, over spec_decode's `max_input_bytes`, batch size > 1) go
back to that client only. A request without apply_chat_template gets spec_decode's setting of
that name. The checks and the encoding are client_request.prompt_ids, which spec_decode's
direct path shares.
"""
import json

from eagle_serve.core.tokenization import text_tokenizer
from eagle_serve.settings import repository_settings, tokenizer_dir
from eagle_serve.triton_backend import client_request as cr
from eagle_serve.triton_backend import io as tu


class TritonPythonModel:
    def initialize(self, args):
        params = tu.model_parameters(json.loads(args["model_config"]))
        folder = tokenizer_dir(params.get("tokenizer_dir", "target"), tu.repository_dir(args))
        self.tokenizer = text_tokenizer(folder)
        settings = repository_settings(tu.repository_dir(args))
        self.max_input_bytes = settings.limits.max_input_bytes
        self.apply_chat_template = settings.api.apply_chat_template
        tu.freeze_loaded_objects()

    def execute(self, requests):
        return tu.respond_each(requests, self.encode)

    def encode(self, request):
        ids = cr.prompt_ids(request, self.tokenizer, self.max_input_bytes,
                            apply_chat_template=self.apply_chat_template)
        return [tu.ids_tensor("input_ids", ids)]
