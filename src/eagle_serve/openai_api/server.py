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
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import AsyncIterator

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from eagle_serve import paths
from eagle_serve.core.tokenization import decode, encode_prompt, render_chat, text_tokenizer
from eagle_serve.openai_api.answers import Answer, Choice
from eagle_serve.openai_api.backend import SpecDecodeClient
from eagle_serve.openai_api.protocol import (
    MAX_TEXT_CHARS,
    ChatCompletionRequest,
    Chunk,
    CompletionRequest,
    DetokenizeRequest,
    GenerateParams,
    OpenAIError,
    SamplingRequest,
    TokenizeRequest,
)
from eagle_serve.openai_api.tool_parser import ToolCallParser
from eagle_serve.openai_api.tools import hermes_messages
from eagle_serve.settings import model_context, read_settings, tokenizer_dir


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
    tokenizer = text_tokenizer(target)  # not AutoTokenizer: see TextTokenizer
    model_id = config.model_name or target.name
    settings = read_settings(Path(config.model_repository))
    max_model_len = settings.scheduler.max_model_len or model_context(target)
    backend: SpecDecodeClient | None = None

    @asynccontextmanager
    async def lifespan(_app):
        nonlocal backend
        backend = SpecDecodeClient(config.grpc_url)  # inside the server's event loop
        yield
        await backend.close()

    app = FastAPI(title="eagle-serve OpenAI-compatible API", lifespan=lifespan)

    def answer(kind: str) -> Answer:
        return Answer(kind, model_id, lambda t: decode(tokenizer, [t], skip_special_tokens=False))

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

    tool_template = settings.api.tool_call_template
    model_renders_tools = tool_template == "model" or (
        tool_template == "auto" and "tools" in (tokenizer.tool_chat_template or ""))

    def chat_prompt(body: ChatCompletionRequest) -> str:
        messages = [m.as_template_dict() for m in body.messages]
        offered = body.tools if body.tool_mode() is not None else None
        try:
            if model_renders_tools:
                specs = [t.model_dump(exclude_none=True) for t in offered] if offered else None
                return tokenizer.apply_chat_template(messages, tools=specs, add_generation_prompt=True,
                                                     tokenize=False)
            return render_chat(tokenizer, hermes_messages(messages, offered))
        except Exception as error:  # the template refused the conversation (e.g. role order)
            raise OpenAIError(400, f"the chat template refused the messages: {error}", "messages") from None

    @app.post("/v1/chat/completions", dependencies=keyed)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model, model_id)
        body.check_supported()
        return await respond(backend, answer("chat"), jobs_of(body, [chat_prompt(body)]), body, request,
                             tool_mode=body.tool_mode())

    # vLLM's render endpoints: the prompt ids a request would run on, without running it. A
    # cache-aware router (vllm-router) asks for them to route requests by their token prefix.
    @app.post("/v1/chat/completions/render", dependencies=keyed)
    async def render_chat_completion(body: ChatCompletionRequest):
        check_model(body.model, model_id)
        return rendered(encode_prompt(tokenizer, chat_prompt(body), apply_chat_template=False))

    @app.post("/v1/completions/render", dependencies=keyed)
    async def render_completion(body: CompletionRequest):
        check_model(body.model, model_id)
        return [rendered(completion_ids(p, body.add_special_tokens)) for p in body.prompts()]

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
        prompts = body.prompts()
        echoes = [p if isinstance(p, str) else decode(tokenizer, p) for p in prompts] if body.echo else None
        ids = [completion_ids(p, body.add_special_tokens) for p in prompts]
        return await respond(backend, answer("completion"), jobs_of(body, ids, echoes), body, request,
                             tokenizer)

    def completion_ids(prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """A completion prompt's ids: text with the tokenizer's own special tokens (a BOS where
        it adds one), as vLLM encodes it; token ids as given."""
        if isinstance(prompt, str):
            if len(prompt) > MAX_TEXT_CHARS:
                raise OpenAIError(400, f"prompt may have at most {MAX_TEXT_CHARS} characters", "prompt")
            ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
            if not ids:
                raise OpenAIError(400, "the prompt encodes to no tokens", "prompt")
            return ids
        if any(not 0 <= t < len(tokenizer) for t in prompt):
            raise OpenAIError(400, f"prompt token ids must lie in [0, {len(tokenizer)})", "prompt")
        return prompt

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


@dataclass(frozen=True)
class Job:
    """One sequence to generate: a choice of the answer."""
    choice: Choice
    prompt: str | list[int]
    params: GenerateParams


def jobs_of(body: SamplingRequest, prompts: list[str | list[int]], echoes: list[str] | None = None) -> list[Job]:
    """n choices per prompt, prompt-major (OpenAI's choice order)."""
    def choice(p: int, i: int, prompt) -> Choice:
        echoed_ids = prompt if echoes and body.prompt_logprobs_count is not None else []
        return Choice(p * body.n + i, p, echo=echoes[p] if echoes else "", prompt_ids=echoed_ids)
    return [Job(choice(p, i, prompt), prompt, body.choice_params(i))
            for p, prompt in enumerate(prompts) for i in range(body.n)]


async def respond(backend: SpecDecodeClient, answer: Answer, jobs: list[Job], body: SamplingRequest,
                  request: Request, tokenizer=None, tool_mode=None):
    """Whole answer, or an SSE stream once every choice's first response came back without
    error. The choices run as requests of their own, side by side."""
    streams = [backend.generate(j.prompt, j.params, body.stream, request_id=f"{answer.id}-{j.choice.index}",
                                tokenizer=tokenizer) for j in jobs]
    with_logprobs = body.top_logprobs_count is not None
    if not body.stream:
        try:
            got = await until_disconnect(request, asyncio.gather(*(collect(s) for s in streams)))
        finally:
            for s in streams:
                await s.aclose()
        for job, chunks in zip(jobs, got):
            for chunk in chunks:
                job.choice.add(chunk)
        return answer.whole([j.choice for j in jobs], with_logprobs, tool_mode)
    try:
        firsts = await until_disconnect(request, asyncio.gather(*(anext(s, None) for s in streams)))
    except BaseException:
        for s in streams:
            await s.aclose()
        raise
    if any(f is None for f in firsts):
        raise OpenAIError(500, "the inference server ended the request without an answer")
    return StreamingResponse(sse(answer, jobs, firsts, streams, body.include_usage, with_logprobs, tool_mode),
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


async def merged(firsts: list[Chunk], streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """(stream index, chunk) as they arrive from every stream, each stream's first chunk first."""
    for i, first in enumerate(firsts):
        yield i, first
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i, stream):
        try:
            async for chunk in stream:
                await queue.put((i, chunk, None))
        except Exception as error:  # noqa: BLE001 (handed to the reader)
            await queue.put((i, None, error))
        await queue.put((i, None, None))
    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            i, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                open_streams -= 1
            else:
                yield i, chunk
    finally:
        for t in tasks:
            t.cancel()


async def sse(answer: Answer, jobs: list[Job], firsts: list[Chunk], streams: list[AsyncIterator[Chunk]],
              include_usage: bool, with_logprobs: bool, tool_mode=None) -> AsyncIterator[str]:
    """OpenAI's stream: (chat) a role chunk per choice, content chunks, one with finish_reason
    per choice, the usage chunk when asked, then [DONE]; an error after the first tokens is an
    `error` event. Starlette cancels this generator when the client disconnects; closing the
    streams then cancels their gRPC streams."""
    def event(data: dict) -> str:
        return f"data: {json.dumps(data)}\n\n"

    try:
        for job, first in zip(jobs, firsts):
            choice = job.choice
            if answer.kind == "chat":
                yield event(answer.chunk(choice.index, "", role=True, include_usage=include_usage))
            elif choice.echo:
                choice.add(replace(first, text="", logprobs=[]))  # the prompt's logprobs
                lp = answer.logprobs(choice.echo_logprobs) if with_logprobs else None
                yield event(answer.chunk(choice.index, choice.echo, include_usage=include_usage, logprobs=lp))
        parsers = [ToolCallParser(tool_mode) for _ in jobs] if tool_mode is not None else None
        try:
            async for i, chunk in merged(firsts, streams):
                choice = jobs[i].choice
                offset = len(choice.echo) + len(choice.text)
                choice.add(chunk)
                if parsers is not None:  # content, then each call's name and argument fragments
                    p = parsers[i]
                    deltas = p.feed(chunk.text) + (p.finish() if chunk.finish_reason else [])
                    for body in answer.tool_events(choice.index, deltas, include_usage):
                        yield event(body)
                    if chunk.finish_reason:
                        reason = p.finish_reason(chunk.finish_reason)
                        yield event(answer.chunk(choice.index, None, reason, include_usage=include_usage))
                    continue
                if chunk.text or chunk.logprobs:
                    lp = answer.logprobs(chunk.logprobs, offset) if with_logprobs else None
                    yield event(answer.chunk(choice.index, chunk.text, include_usage=include_usage, logprobs=lp))
                if chunk.finish_reason:
                    yield event(answer.chunk(choice.index, None, chunk.finish_reason, include_usage=include_usage))
        except OpenAIError as error:
            yield event(error.body())
        else:
            if include_usage:
                yield event(answer.usage_chunk([j.choice for j in jobs]))
        yield "data: [DONE]\n\n"
    finally:
        for s in streams:
            await s.aclose()


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
