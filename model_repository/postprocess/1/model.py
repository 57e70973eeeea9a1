"""Triton model `postprocess`: (prev_ids, output_ids, finish_reason) -> text_output [1, 1].

Stateless: the text of `output_ids` is decode(prev_ids + output_ids) minus decode(prev_ids),
an incomplete UTF-8 tail held back unless finish_reason is non-empty (see
eagle_serve.core.tokenization). Exactly one instance, so a stream's responses stay in order.
"""
import json

from eagle_serve.core.tokenization import decode_delta, text_tokenizer
from eagle_serve.settings import tokenizer_dir
from eagle_serve.triton_backend import client_request as cr
from eagle_serve.triton_backend import io as tu


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        tu.require_single_instance(config)
        params = tu.model_parameters(config)
        folder = tokenizer_dir(params.get("tokenizer_dir", "target"), tu.repository_dir(args))
        self.tokenizer = text_tokenizer(folder, renders_chat=False)
        self.vocab_size = len(self.tokenizer)
        self.skip_special_tokens = tu.flag(params.get("skip_special_tokens", "true"))
        tu.freeze_loaded_objects()

    def execute(self, requests):
        return tu.respond_each(requests, self.detokenize)

    def detokenize(self, request):
        new_ids = self.ids(request, "output_ids", required=True)
        prev_ids = self.ids(request, "prev_ids")
        final = bool(cr.text(request, "finish_reason", default=""))
        text = decode_delta(self.tokenizer, prev_ids, new_ids, final, self.skip_special_tokens)
        return [tu.text_tensor("text_output", text)]

    def ids(self, request, name, required=False):
        values = cr.row(request, name, required)
        if values is None:
            return []
        bad = values[(values < 0) | (values >= self.vocab_size)]
        if bad.size:
            raise cr.RequestError(f"input '{name}' holds ids outside the vocabulary "
                                  f"[0, {self.vocab_size}): {bad[:8].tolist()}")
        return values.tolist()
