"""A Triton request's inputs -> a typed `ClientRequest` (prompt ids, SamplingParams, the
response options), in one place: every input is read, checked and bounded here, and anything
wrong is a `RequestError` whose message goes back to that client alone.

Requests carry a batch dimension (max_batch_size > 0) and one prompt each: a batch of more than
one row is refused with a clear error rather than guessing how to pad ragged outputs.
`prompt_ids` is where text input is checked and encoded (eagle_serve.core.tokenization), for
preprocess and the direct path alike. Inputs that NVIDIA's tools send are read here too:
aliases of ours (TensorRT-LLM's names), flags with the one value that makes sense, and
return_num_output_tokens. `triton_python_backend_utils` exists only inside the backend stub, so
it is imported lazily (tests put a stand-in into `sys.modules`).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from eagle_serve.core.grammar import MAX_GUIDE_BYTES
from eagle_serve.core.requests import (
    MAX_BAD_WORDS,
    MAX_CACHE_SALT_BYTES,
    MAX_LOGIT_BIAS,
    MAX_STOP_BYTES,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from eagle_serve.core.tokenization import encode_prompt, has_chat_template
from eagle_serve.settings import LimitSettings
from eagle_serve.triton_backend.io import RequestError, pb


def input_array(request, name: str, required: bool = False) -> np.ndarray | None:
    """The input as numpy ([1, ...] with the batch row), None if absent and not required."""
    tensor = pb().get_input_tensor_by_name(request, name)
    if tensor is None:
        if required:
            raise RequestError(f"input '{name}' is required")
        return None
    array = tensor.as_numpy()
    if array.ndim >= 2 and array.shape[0] != 1:
        raise RequestError(f"input '{name}' has batch size {array.shape[0]}; "
                           f"send one prompt per request (batch size 1)")
    return array


def row(request, name: str, required: bool = False) -> np.ndarray | None:
    """The single batch row of an input, flattened to 1-D."""
    array = input_array(request, name, required)
    return None if array is None else array.reshape(-1)


def scalar(request, name: str, default=None, required: bool = False):
    """A one-value input as a Python scalar (bytes for BYTES), `default` if absent."""
    values = row(request, name, required)
    if values is None:
        return default
    if values.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got {values.size}")
    value = values[0]
    return value.item() if isinstance(value, np.generic) else value


def utf8(raw: bytes, name: str, max_bytes: int | None = None) -> str:
    """Strictly decoded text, with the offending byte named when it is not UTF-8."""
    if max_bytes is not None and len(raw) > max_bytes:
        raise RequestError(f"input '{name}' has {len(raw)} bytes, more than the limit of "
                           f"{max_bytes}")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as error:
        bad = raw[error.start]
        raise RequestError(f"input '{name}' is not valid UTF-8 (byte 0x{bad:02x} at offset "
                           f"{error.start})") from None


def text(request, name: str, default: str | None = None, required: bool = False,
         max_bytes: int | None = None) -> str | None:
    raw = scalar(request, name, None, required)
    return default if raw is None else utf8(bytes(raw), name, max_bytes)


def texts(request, name: str, max_bytes: int | None = None) -> list[str]:
    """All strings of a BYTES [-1] input (e.g. stop strings); [] if absent."""
    values = row(request, name)
    return [] if values is None else [utf8(bytes(v), name, max_bytes) for v in values]


def prompt_ids(request, tokenizer, max_bytes: int, required: bool = True,
               apply_chat_template: bool = True) -> list[int] | None:
    """The ids of the request's `text_input`, through the chat template if the request's
    `apply_chat_template` (default: the argument of that name) says so; None when the text is
    absent and not required."""
    value = text(request, "text_input", required=required, max_bytes=max_bytes)
    if value is None:
        return None
    if not value:
        raise RequestError("input 'text_input' is empty")
    use_template = bool(scalar(request, "apply_chat_template", apply_chat_template))
    if use_template and not has_chat_template(tokenizer):
        raise RequestError("this tokenizer has no chat template: "
                           "send apply_chat_template=false with a raw prompt")
    ids = encode_prompt(tokenizer, value, use_template)
    if not ids:
        raise RequestError("the prompt encodes to no tokens")
    return ids



@dataclass(frozen=True)
class ClientRequest:
    """One request as the engine and the responses need it."""
    prompt: list[int]
    direct: bool                    # came with text_input (send text_output back)
    params: SamplingParams
    stream: bool
    count_per_response: bool        # return_num_output_tokens: num_output_tokens is the number
    #                                 of tokens in each response (the vLLM and TensorRT-LLM
    #                                 backends' meaning, which Triton's OpenAI frontend sums)


# Inputs that NVIDIA's tools send under other names (TensorRT-LLM's): same meaning, same type.
ALIASES = {"seed": "random_seed", "min_tokens": "min_length", "stop": "stop_words"}


def read_request(request, tokenizer, max_input_bytes: int = LimitSettings.max_input_bytes,
                 apply_chat_template: bool = True, defaults: dict | None = None) -> ClientRequest:
    """A Triton request's inputs -> ClientRequest (RequestError if bad). apply_chat_template:
    the default of the input of that name; defaults: the model's sampling defaults
    (settings.generation_defaults) for inputs the request does not send."""
    prompt, direct = read_prompt(request, tokenizer, max_input_bytes, apply_chat_template)
    params, stream = read_params(request, defaults=defaults or {})
    return ClientRequest(prompt, direct, params, stream,
                         bool(scalar(request, "return_num_output_tokens", False)))


def read_prompt(request, tokenizer, max_input_bytes: int,
                apply_chat_template: bool = True) -> tuple[list[int], bool]:
    """-> prompt ids, and whether the request came with text (the direct path)."""
    ids = prompt_ids(request, tokenizer, max_input_bytes, required=False,
                        apply_chat_template=apply_chat_template)
    if ids is not None:
        return ids, True
    ids = row(request, "input_ids")
    if ids is None:
        raise RequestError("send text_input (or input_ids)")
    if ids.size == 0:
        raise RequestError("input_ids is empty")
    return [int(x) for x in ids], False


def read_params(request, defaults: dict | None = None) -> tuple[SamplingParams, bool]:
    """One request's sampling parameters and stream flag (RequestError if bad)."""
    d = defaults or {}
    check_tool_inputs(request)
    k = scalar(request, "num_speculative_tokens")
    topk, depth = scalar(request, "draft_topk"), scalar(request, "draft_depth")
    seed = aliased(request, "seed", scalar)
    stop = aliased(request, "stop", lambda r, name: texts(r, name, max_bytes=MAX_STOP_BYTES) or None)
    params = SamplingParams(
        max_tokens=int(scalar(request, "max_tokens", d.get("max_tokens", 128))),
        temperature=float(scalar(request, "temperature", d.get("temperature", 0.0))),
        top_p=float(scalar(request, "top_p", d.get("top_p", 1.0))),
        top_k=int(scalar(request, "top_k", d.get("top_k", 0))),
        seed=None if seed is None else int(seed),
        num_speculative_tokens=None if k is None else int(k),
        draft_topk=None if topk is None else int(topk),
        draft_depth=None if depth is None else int(depth),
        stop=tuple(stop or ()),
        ignore_eos=bool(scalar(request, "ignore_eos", False)),
        context_lookup=bool(scalar(request, "context_lookup", True)),
        corpus_lookup=bool(scalar(request, "corpus_lookup", True)),
        min_tokens=int(aliased(request, "min_tokens", scalar) or 0),
        cache_salt=text(request, "cache_salt", "", max_bytes=MAX_CACHE_SALT_BYTES),
        **processor_params(request, d))
    return params, bool(scalar(request, "stream", False))


def processor_params(request, defaults: dict) -> dict:
    """The logits processors' and logprobs' inputs -> SamplingParams fields (bounded before they
    are read into Python lists: eagle_serve.core.processors' limits)."""
    bias_ids, bias_values = (bounded_row(request, n, MAX_LOGIT_BIAS) for n in ("logit_bias_ids", "logit_bias_values"))
    if (bias_ids is None) != (bias_values is None) or (bias_ids is not None and bias_ids.size != bias_values.size):
        raise RequestError("logit_bias_ids and logit_bias_values go together, one value per id")
    logprobs, prompt_logprobs = scalar(request, "logprobs"), scalar(request, "prompt_logprobs")
    if logprobs is None and scalar(request, "return_log_probs", False):  # TensorRT-LLM's flag
        logprobs = 0
    stop_ids = bounded_row(request, "stop_token_ids", MAX_STOP_TOKEN_IDS)
    bad_words = bounded_row(request, "bad_words", MAX_BAD_WORDS)
    return dict(
        presence_penalty=float(scalar(request, "presence_penalty", 0.0)),
        frequency_penalty=float(scalar(request, "frequency_penalty", 0.0)),
        repetition_penalty=float(scalar(request, "repetition_penalty", defaults.get("repetition_penalty", 1.0))),
        min_p=float(scalar(request, "min_p", defaults.get("min_p", 0.0))),
        logit_bias=() if bias_ids is None else tuple(zip(bias_ids.tolist(), bias_values.tolist())),
        stop_token_ids=() if stop_ids is None else tuple(stop_ids.tolist()),
        bad_words=() if bad_words is None else tuple(utf8(bytes(w), "bad_words", 256) for w in bad_words),
        logprobs=None if logprobs is None else int(logprobs),
        prompt_logprobs=None if prompt_logprobs is None else int(prompt_logprobs),
        guide=read_guide(request))


def read_guide(request) -> tuple[str, str] | None:
    """TensorRT-LLM's guided_decoding_guide_type and guided_decoding_guide (None: neither)."""
    kind = text(request, "guided_decoding_guide_type", max_bytes=64)
    guide = text(request, "guided_decoding_guide", "", max_bytes=MAX_GUIDE_BYTES)
    if kind is None:
        if guide:
            raise RequestError("guided_decoding_guide needs guided_decoding_guide_type")
        return None
    return kind, guide


def bounded_row(request, name: str, limit: int) -> np.ndarray | None:
    values = row(request, name)
    if values is not None and values.size > limit:
        raise RequestError(f"input '{name}' may hold at most {limit} values, got {values.size}")
    return values


def aliased(request, name: str, read):
    """The value of input `name` or of its alias (None if neither is sent); both sent must agree."""
    values = {n: read(request, n) for n in (name, ALIASES[name])}
    given = {n: v for n, v in values.items() if v is not None}
    if len(given) == 2 and values[name] != values[ALIASES[name]]:
        raise RequestError(f"inputs '{name}' and '{ALIASES[name]}' mean the same and disagree: "
                              f"{values[name]!r} vs {values[ALIASES[name]]!r}; send one of them")
    return next(iter(given.values()), None)


def check_tool_inputs(request) -> None:
    """Inputs NVIDIA's tools send that only one value of makes sense here (RequestError else).
    return_num_input_tokens is accepted and needs nothing: the counters are always sent."""
    if not scalar(request, "exclude_input_in_output", True):
        raise RequestError("exclude_input_in_output=false is not supported: the output never "
                              "includes the prompt")
