"""Small helpers shared by the Python-backend models: config parameters, building tensors and
error responses (a request's inputs are read in triton_backend.client_request).

`triton_python_backend_utils` exists only inside the backend stub, so it is imported lazily
(tests put a stand-in into `sys.modules`). Requests carry a batch dimension (max_batch_size > 0)
and one prompt each. Knows nothing about the engine.
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
