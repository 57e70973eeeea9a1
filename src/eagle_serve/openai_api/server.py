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
import secrets
import urllib.request
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from eagle_serve import paths
from eagle_serve.openai_api.backend import SpecDecodeClient
from eagle_serve.openai_api.protocol import (Answer, ChatCompletionRequest, Chunk,
                                             CompletionRequest, DetokenizeRequest, OpenAIError,
                                             SamplingRequest, TokenizeRequest)
from eagle_serve.settings import model_context, read_settings, tokenizer_dir
from eagle_serve.tokenization import decode, encode_prompt, load_tokenizer, render_chat


@dataclass(frozen=True)
class OpenAIServerConfig:
    model_repository: Path                  # its spec_decode names the target (tokenizer, id)
    grpc_url: str = "localhost:8001"        # Triton's gRPC endpoint
    metrics_url: str = "localhost:8002"     # Triton's metrics endpoint, passed on at /metrics
    model_name: str | None = None           # the id in /v1/models; None = the target folder's name
    host: str = "0.0.0.0"
    port: int = 9000
    api_keys: tuple[str, ...] = ()          # non-empty: /v1/* needs `Authorization: Bearer <key>`


def create_app(config: OpenAIServerConfig) -> FastAPI:
    target = tokenizer_dir("target", Path(config.model_repository))
    tokenizer = load_tokenizer(target)
    model_id = config.model_name or target.name
    max_model_len = read_settings(Path(config.model_repository)).max_model_len or model_context(target)
    backend: SpecDecodeClient | None = None

    @asynccontextmanager
    async def lifespan(_app):
        nonlocal backend
        backend = SpecDecodeClient(config.grpc_url)  # inside the server's event loop
        yield
        await backend.close()

    app = FastAPI(title="eagle-serve OpenAI-compatible API", lifespan=lifespan)

    async def require_key(request: Request):
        # health and metrics stay open for probes and scrapers; the API needs a key when set
        if config.api_keys and not authorized(request.headers.get("authorization"), config.api_keys):
            raise OpenAIError(401, "a valid API key is needed: `Authorization: Bearer <key>`",
                              code="invalid_api_key")
    keyed = [Depends(require_key)]

    @app.exception_handler(OpenAIError)
    async def openai_error(_request, error: OpenAIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(ClientDisconnected)
    async def client_gone(_request, _error):
        return Response(status_code=499)  # nobody reads it: nginx's "client closed request"

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_request, error: RequestValidationError):
        return JSONResponse(validation_error(error).body(), status_code=400)

    @app.get("/v1/models", dependencies=keyed)
    async def models():
        return {"object": "list", "data": [model_card(model_id)]}

    @app.get("/v1/models/{name:path}", dependencies=keyed)
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

    def chat_prompt(body: ChatCompletionRequest) -> str:
        try:
            return render_chat(tokenizer, [m.as_template_dict() for m in body.messages])
        except Exception as error:  # the template refused the conversation (e.g. role order)
            raise OpenAIError(400, f"the chat template refused the messages: {error}", "messages") from None

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model, model_id)
        body.check_supported()
        return await respond(backend, Answer("chat", model_id), chat_prompt(body), body, request)

    # vLLM's render endpoints: the prompt ids a request would run on, without running it. A
    # cache-aware router (vllm-router) asks for them to route requests by their token prefix.
    @app.post("/v1/chat/completions/render", dependencies=keyed)
    async def render_chat_completion(body: ChatCompletionRequest):
        check_model(body.model, model_id)
        return rendered(encode_prompt(tokenizer, chat_prompt(body), apply_chat_template=False))

    @app.post("/v1/completions/render", dependencies=keyed)
    async def render_completion(body: CompletionRequest):
        check_model(body.model, model_id)
        return [rendered(encode_prompt(tokenizer, body.text(), apply_chat_template=False))]

    @app.post("/tokenize", dependencies=keyed)
    async def tokenize(body: TokenizeRequest):
        check_model(body.model, model_id)
        if body.messages is not None:
            ids = encode_prompt(tokenizer, chat_prompt(body.as_chat()), apply_chat_template=False)
        else:
            ids = list(tokenizer(body.prompt or "", add_special_tokens=body.add_special_tokens)["input_ids"])
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": None}

    @app.post("/detokenize", dependencies=keyed)
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model, model_id)
        if any(not 0 <= t < len(tokenizer) for t in body.tokens):
            raise OpenAIError(400, f"token ids must lie in [0, {len(tokenizer)})", "tokens")
        return {"prompt": decode(tokenizer, body.tokens, skip_special_tokens=False)}

    @app.post("/v1/completions", dependencies=keyed)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model, model_id)
        body.check_supported()
        return await respond(backend, Answer("completion", model_id), body.text(), body, request)

    return app


def api_keys_from(value: str | None) -> tuple[str, ...]:
    """`EAGLE_API_KEY`: one key, or several separated by commas."""
    return tuple(k.strip() for k in (value or "").split(",") if k.strip())


def authorized(header: str | None, keys: tuple[str, ...]) -> bool:
    scheme, _, key = (header or "").partition(" ")
    # compare_digest on every key: the time taken does not tell how much of a key matched
    matches = [secrets.compare_digest(key.strip().encode(), k.encode()) for k in keys]
    return scheme.lower() == "bearer" and any(matches)


def rendered(ids: list[int]) -> dict:
    return {"request_id": f"render-{uuid.uuid4().hex}", "token_ids": ids}


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
                                args.model_name, args.host, args.port,
                                api_keys_from(os.environ.get("EAGLE_API_KEY")))
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=5)
