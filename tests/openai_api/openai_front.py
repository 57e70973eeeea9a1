"""The OpenAI-compatible server (eagle_serve.openai_api) as the tests drive it: launched in
front of a tritonserver of the pool, called with the official `openai` client."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import openai
from triton_pool import get
from triton_pool import wait_until as server_wait_until

from eagle_serve.server.launch import TritonServer, free_ports

PROMPT = "Write a haiku about the sea."
READY_TIMEOUT_S = 240.0


@dataclass
class OpenAIServer:
    process: subprocess.Popen
    port: int
    log_path: Path

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0,
                             **{"timeout": 120.0, **kw})

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.process.wait()


def wait_until(predicate, timeout_s: float, every_s: float = 0.5) -> bool:
    """server.wait_until, where a 503 while Triton starts also means not yet."""
    return server_wait_until(predicate, timeout_s, every_s, ignore=(OSError, openai.APIError))


def launch_openai(triton: TritonServer, log_path: Path, env: dict[str, str] | None = None) -> OpenAIServer:
    port = free_ports(1)[0]
    cmd = [sys.executable, "-m", "eagle_serve.openai_api", f"--model-repository={triton.repo}",
           f"--grpc-url={triton.grpc_url}", f"--metrics-url={triton.metrics_url}",
           "--host=127.0.0.1", f"--port={port}"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   env=None if env is None else {**os.environ, **env})
    server = OpenAIServer(process, port, log_path)
    healthy = wait_until(lambda: process.poll() is None and get(f"{server.base_url}/health")[0] == 200,
                         READY_TIMEOUT_S)
    if not healthy:
        server.stop()
        raise RuntimeError(f"the OpenAI server did not become healthy:\n{log_path.read_text()[-3000:]}")
    return server


def chat(api: OpenAIServer, messages, **kw):
    return api.client().chat.completions.create(model="tiny-llama", messages=messages, **kw)


def streamed_chat(api: OpenAIServer, messages, **kw) -> tuple[str, list]:
    chunks = list(chat(api, messages, stream=True, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]
