"""The OpenAI-compatible HTTP server: FastAPI routes in front of spec_decode.

Chat messages go through the target's chat template here (the tokenizer preprocess loads) and
reach spec_decode as a raw prompt, so a single user message gives exactly the ensemble's
prompt ids. A client that disconnects, streaming or not, cancels its spec_decode stream.
Streams answer with HTTP errors until the first tokens arrive (bad parameters, server busy),
then with an `error` event. Run it with `python -m eagle_serve.openai_api`; `make serve`
starts it beside tritonserver.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import urllib.request
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from eagle_serve import paths
from eagle_serve.openai_api.backend import SpecDecodeClient
from eagle_serve.openai_api.protocol import (Answer, ChatCompletionRequest, Chunk,
                                             CompletionRequest, OpenAIError, SamplingRequest)
from eagle_serve.settings import tokenizer_dir
from eagle_serve.tokenization import load_tokenizer, render_chat


@dataclass(frozen=True)
class OpenAIServerConfig:
    model_repository: Path                  # its spec_decode names the target (tokenizer, id)
    grpc_url: str = "localhost:8001"        # Triton's gRPC endpoint
    metrics_url: str = "localhost:8002"     # Triton's metrics endpoint, passed on at /metrics
    model_name: str | None = None           # the id in /v1/models; None = the target folder's name
    host: str = "0.0.0.0"
    port: int = 9000


def create_app(config: OpenAIServerConfig) -> FastAPI:
    target = tokenizer_dir("target", Path(config.model_repository))
    tokenizer = load_tokenizer(target)
    model_id = config.model_name or target.name
    backend: SpecDecodeClient | None = None

    @asynccontextmanager
    async def lifespan(_app):
        nonlocal backend
        backend = SpecDecodeClient(config.grpc_url)  # inside the server's event loop
        yield
        await backend.close()

    app = FastAPI(title="eagle-serve OpenAI-compatible API", lifespan=lifespan)

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request, _error):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, error: RequestValidationError):
        return JSONResponse(validation_error(error).body(), status_code=400)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(model_id)]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        check_model(name, model_id)
        return model_card(model_id)

    @app.get("/health")
    async def health():
        if await backend.ready():
            return {"status": "ok"}
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/metrics")
    async def metrics():
        try:
            text = await asyncio.to_thread(read_url, f"http://{config.metrics_url}/metrics")
        except OSError as error:
            raise OpenAIError(503, f"Triton's metrics endpoint is not reachable: {error}") from None
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model, model_id)
        body.check_supported()
        try:
            prompt = render_chat(tokenizer, [m.as_template_dict() for m in body.messages])
        except Exception as error:  # the template refused the conversation (e.g. role order)
            raise OpenAIError(400, f"the chat template refused the messages: {error}", "messages") from None
        return await respond(backend, Answer("chat", model_id), prompt, body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, model_id)
        body.check_supported()
        return await respond(backend, Answer("completion", model_id), body.text(), body, request)

    return app


def read_url(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def model_card(model_id: str) -> dict:
    return {"id": model_id, "object": "model", "created": 0, "owned_by": "eagle-serve"}


def check_model(name: str | None, model_id: str) -> None:
    if name is not None and name != model_id:
        raise OpenAIError(404, f"The model `{name}` does not exist (this server serves "
                               f"`{model_id}`)", "model", "model_not_found")


def validation_error(error: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 body -> one 400 naming the first bad field."""
    first = error.errors()[0]
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    name = ".".join(where) or "body"
    return OpenAIError(400, f"{name}: {first.get('msg')}", where[0] if where else None)


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready."""


async def respond(backend: SpecDecodeClient, answer: Answer, prompt: str, body: SamplingRequest,
                  request: Request):
    """Whole answer, or an SSE stream once the first response came back without error."""
    chunks = backend.generate(prompt, body.params(), body.stream, request_id=answer.id)
    if not body.stream:
        async with aclosing(chunks):
            got = await until_disconnect(request, collect(chunks))
        return answer.whole("".join(c.text for c in got), got[-1])
    try:
        first = await until_disconnect(request, anext(chunks, None))
    except BaseException:
        await chunks.aclose()
        raise
    if first is None:
        raise OpenAIError(500, "the inference server ended the request without an answer")
    return StreamingResponse(sse(answer, first, chunks, body.include_usage),
                             media_type="text/event-stream")


async def collect(chunks: AsyncIterator[Chunk]) -> list[Chunk]:
    got = [c async for c in chunks]
    if not got:
        raise OpenAIError(500, "the inference server ended the request without an answer")
    return got


async def until_disconnect(request: Request, work):
    """Await `work`; if the HTTP client disconnects first, cancel it (and with it the gRPC
    stream) and raise ClientDisconnected. The request body has been read: `receive` now only
    reports the disconnect."""
    task = asyncio.ensure_future(work)

    async def disconnected():
        while (await request.receive())["type"] != "http.disconnect":
            pass
    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler itself is cancelled
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})  # the cancel runs through to the gRPC stream
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def sse(answer: Answer, first: Chunk, rest: AsyncIterator[Chunk],
              include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's stream: (chat) a role chunk, content chunks, one with finish_reason, the usage
    chunk when asked, then [DONE]; an error after the first tokens is an `error` event.
    Starlette cancels this generator when the client disconnects; closing `rest` then
    cancels the gRPC stream."""
    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    async def all_chunks():
        yield first
        async for chunk in rest:
            yield chunk

    async with aclosing(rest):
        if answer.kind == "chat":
            yield event(answer.chunk("", role=True, include_usage=include_usage))
        last = first
        try:
            async for chunk in all_chunks():
                last = chunk
                if chunk.text:
                    yield event(answer.chunk(chunk.text, include_usage=include_usage))
                if chunk.finish_reason:
                    yield event(answer.chunk(None, chunk.finish_reason, include_usage=include_usage))
        except OpenAIError as error:
            yield event(error.body())
        else:
            if include_usage:
                yield event(answer.usage_chunk(last))
        yield "data: [DONE]\n\n"


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(description="OpenAI-compatible API in front of Triton's spec_decode")
    parser.add_argument("--model-repository", default=str(paths.REPO_ROOT / "model_repository"))
    parser.add_argument("--grpc-url", default=f"localhost:{os.environ.get('GRPC_PORT', 8001)}")
    parser.add_argument("--metrics-url", default=f"localhost:{os.environ.get('METRICS_PORT', 8002)}")
    parser.add_argument("--model-name", default=os.environ.get("OPENAI_MODEL_NAME"),
                        help="model id clients send (default: the target folder's name)")
    parser.add_argument("--host", default=os.environ.get("OPENAI_HOST", "0.0.0.0"))
    parser.add_argument("--port", type=int, default=int(os.environ.get("OPENAI_PORT", 9000)))
    args = parser.parse_args(argv)
    config = OpenAIServerConfig(Path(args.model_repository), args.grpc_url, args.metrics_url,
                                args.model_name, args.host, args.port)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=5)
