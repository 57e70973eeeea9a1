"""spec_decode over gRPC streaming, with tritonclient's asyncio client.

Each request is one gRPC stream to `spec_decode` (not the ensemble: in Triton 2.51 only a
model called directly sees a client's cancel). The stream is half-closed once the request is
written, so Triton ends it after the request's last response. Leaving `generate` early (the
HTTP client went away, its task was cancelled) cancels the stream, and spec_decode frees the
request's KV pages and draft slots at its next round. One channel serves every request and
reconnects by itself when tritonserver restarts. Knows nothing about HTTP.
"""
from __future__ import annotations

from dataclasses import asdict, fields
from typing import AsyncIterator

import grpc
import tritonclient.grpc.aio as grpc_aio
from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

from eagle_serve.client import grpc_inputs
from eagle_serve.core.requests import TokenLogprob
from eagle_serve.core.tokenization import decode_delta
from eagle_serve.openai_api.protocol import Chunk, Counters, GenerateParams, OpenAIError

MODEL = "spec_decode"
CHANNEL_ARGS = [
    ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
    ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
    # gRPC's reconnect backoff grows to 120 s by default: a restarted server is found late
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# Error messages that mean "not now" (503) rather than "bad request" (400): spec_decode's
# queue is full or it is stopping, or Triton cannot run the model at the moment.
UNAVAILABLE = ("server busy", "shutting down", "unknown model", "is not ready", "not healthy")
PARAMS = {f.name for f in fields(GenerateParams)}


def error_from_message(message: str) -> OpenAIError:
    """spec_decode's error text -> the OpenAI error (the gRPC stream carries no status code)."""
    if any(marker in message for marker in UNAVAILABLE):
        return OpenAIError(503, message, code="unavailable")
    if message.startswith("engine error"):
        return OpenAIError(500, message, code="internal_error")
    first = message.split(" ", 1)[0]  # spec_decode names the parameter first: "top_p must be ..."
    return OpenAIError(400, message, param=first if first in PARAMS else None)


def error_from_rpc(error: grpc.RpcError) -> OpenAIError:
    if error.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return OpenAIError(503, f"the inference server is not reachable: {error.details()}",
                           code="unavailable")
    return OpenAIError(500, f"inference server error: {error.details()}", code="internal_error")


def read_chunk(result, tokenizer=None, prompt: list[int] | None = None) -> Chunk:
    """tokenizer: decode the text here (a token-id prompt: spec_decode sends no text then)."""
    def scalar(name):
        return result.as_numpy(name).reshape(-1)[0]
    counters = Counters(input_tokens=int(scalar("num_input_tokens")),
                        output_tokens=int(scalar("num_output_tokens")),
                        draft_tokens=int(scalar("num_draft_tokens")),
                        accepted_tokens=int(scalar("num_accepted_tokens")),
                        rounds=int(scalar("num_rounds")),
                        cached_tokens=int(scalar("num_cached_tokens")))
    finish = scalar("finish_reason").decode()
    if tokenizer is None:
        text = scalar("text_output").decode("utf-8", errors="replace")
    else:
        ids, prev = (result.as_numpy(n).reshape(-1).tolist() for n in ("output_ids", "prev_ids"))
        text = decode_delta(tokenizer, prev, ids, bool(finish))
    prompt_logprobs = read_logprobs(result, prompt[1:], "prompt_") if prompt else []
    return Chunk(text, counters, finish, read_logprobs(result, None), prompt_logprobs or None)


def read_logprobs(result, ids: list[int] | None, prefix: str = "") -> list[TokenLogprob]:
    """The response's logprobs (prefix "prompt_": the prompt's, of `ids`; else of output_ids)."""
    chosen = result.as_numpy("prompt_log_probs" if prefix else "output_log_probs")
    if chosen is None or chosen.size == 0:
        return []
    ids = ids if ids is not None else result.as_numpy("output_ids").reshape(-1).tolist()
    top_ids, top = result.as_numpy(prefix + "top_logprob_ids"), result.as_numpy(prefix + "top_logprobs")
    width = top_ids.shape[-1]
    n = chosen.size
    top_ids, top = top_ids.reshape(n, width).tolist(), top.reshape(n, width).tolist()
    return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in
            zip(ids, chosen.reshape(-1).tolist(), top_ids, top)]


class SpecDecodeClient:
    def __init__(self, url: str, model: str = MODEL):
        self.model = model
        self._client = grpc_aio.InferenceServerClient(url, channel_args=CHANNEL_ARGS)

    async def close(self) -> None:
        await self._client.close()

    async def ready(self, timeout_s: float = 2.0) -> bool:
        try:
            return bool(await self._client.is_model_ready(self.model, client_timeout=timeout_s))
        except Exception:  # unreachable, restarting: not ready
            return False

    async def generate(self, prompt: str | list[int], params: GenerateParams, stream: bool,
                       request_id: str = "", tokenizer=None) -> AsyncIterator[Chunk]:
        """The responses of one request: one Chunk (stream=False) or one per round. `prompt`
        is sent as is (apply_chat_template=false), or as token ids (then `tokenizer` decodes
        the output). Raises OpenAIError."""
        values = {k: v for k, v in asdict(params).items() if k != "stop"}
        template = {"apply_chat_template": False} if isinstance(prompt, str) else {}
        inputs = grpc_inputs(prompt, stop=list(params.stop), stream=stream, **template, **values)
        decoder = None if isinstance(prompt, str) else tokenizer

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": request_id}

        call = self._client.stream_infer(requests())
        try:
            async for result, error in call:
                if error is not None:
                    raise error_from_message(error.message())
                yield read_chunk(result, decoder, None if isinstance(prompt, str) else prompt)
        except grpc.RpcError as error:
            raise error_from_rpc(error) from None
        finally:
            call.cancel()  # a no-op once Triton has ended the stream
