"""Small helpers shared by the Python-backend models: config parameters, reading one request's
inputs with defaults, building tensors and error responses.

`triton_python_backend_utils` exists only inside the backend stub, so it is imported lazily
(tests put a stand-in into `sys.modules`). Requests carry a batch dimension (max_batch_size > 0)
and one prompt each: a batch of more than one row is refused with a clear error rather than
guessing how to pad ragged outputs. Knows nothing about the engine; `prompt_ids` is where text
input is checked and encoded (eagle_serve.core.tokenization), for preprocess and the direct path alike.
"""
from __future__ import annotations

import gc
import os
import signal
import traceback
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from eagle_serve.core.tokenization import encode_prompt, has_chat_template

TRUE_WORDS = ("1", "true", "yes", "on")


class RequestError(ValueError):
    """Something wrong with one request's inputs; the message goes back to that client."""


def pb():
    import triton_python_backend_utils

    return triton_python_backend_utils


def model_parameters(model_config: dict) -> dict[str, str]:
    """config.pbtxt `parameters` as plain strings."""
    return {key: value.get("string_value", "")
            for key, value in model_config.get("parameters", {}).items()}


def flag(value: str) -> bool:
    return str(value).strip().lower() in TRUE_WORDS


def instance_count(model_config: dict) -> int:
    """Instances across all instance groups (a KIND_GPU group counts once per listed GPU)."""
    total = 0
    for group in model_config.get("instance_group", []):
        gpus = group.get("gpus") or [None]
        total += int(group.get("count", 1)) * (len(gpus) if group.get("kind") == "KIND_GPU" else 1)
    return total


def require_single_instance(model_config: dict) -> None:
    count = instance_count(model_config)
    if count != 1:
        raise ValueError(f"model '{model_config.get('name')}' must run exactly one instance, "
                         f"config asks for {count}: scale out with more servers instead")


def repository_dir(args: dict) -> Path:
    """The model repository folder (`args["model_repository"]` is the model's own folder)."""
    return Path(args["model_repository"]).parent


def freeze_loaded_objects() -> None:
    """The end of a model's `initialize`: what it loaded (torch, transformers, the weights' modules:
    ~400k objects) leaves the garbage collector's generations (gc.freeze), so no full collection
    walks them again while requests wait (measured: 80-430 ms each, one right after start-up)."""
    gc.collect()
    gc.freeze()


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


def ids_tensor(name: str, ids) -> object:
    return pb().Tensor(name, np.asarray(ids, dtype=np.int32).reshape(1, -1))  # [1, L]


def int_tensor(name: str, value: int) -> object:
    return pb().Tensor(name, np.array([[value]], dtype=np.int32))  # [1, 1]


def text_tensor(name: str, value: str) -> object:
    return pb().Tensor(name, np.array([[value.encode("utf-8")]], dtype=np.object_))  # [1, 1]


def error_response(message: str, code: str = "INVALID_ARG"):
    """A response carrying only an error (`code` names a TritonError code where it has one)."""
    pb_utils = pb()
    code = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def respond_each(requests, handler: Callable[[object], list]) -> list:
    """One response per request from `handler(request) -> output tensors`. A failing request
    gets its own error response (a RequestError's message, or a generic one with an error id
    for a bug, whose details go to the log); the others in the batch are answered normally."""
    responses = []
    for request in requests:
        try:
            responses.append(pb().InferenceResponse(output_tensors=handler(request)))
        except RequestError as error:
            responses.append(error_response(str(error)))
        except Exception:  # a bug: log it, answer only this request, without internals
            error_id = uuid.uuid4().hex[:12]
            pb().Logger.log_error(f"error id {error_id}:\n{traceback.format_exc()}")
            responses.append(error_response(f"internal error (error id {error_id}); the server "
                                            f"log has the details", "INTERNAL"))
    return responses


def stop_server(reason: str) -> None:
    """Ask the tritonserver this model process belongs to to shut down (SIGTERM: open requests
    end, then it exits), so that whatever supervises it (`make serve`'s supervisor, compose,
    Kubernetes) starts it again. Triton keeps reporting ready while a model process is stuck or
    dead, so exiting is how a broken model turns readiness red."""
    import psutil

    server = psutil.Process(os.getppid())
    if server.name() != "tritonserver":
        pb().Logger.log_error(f"not stopping {server.name()} (pid {server.pid}): not tritonserver")
        return
    pb().Logger.log_error(f"stopping tritonserver (pid {server.pid}): {reason}")
    server.send_signal(signal.SIGTERM)
