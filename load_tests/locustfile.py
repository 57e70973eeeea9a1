"""Load test of the `ensemble` model with varied prompts and sampling parameters.

    locust -f load_tests/locustfile.py --headless -u 4 -r 4 -t 30s --host http://localhost:8000
        HTTP /generate only: the default user class.
    GRPC_PORT=8001 locust -f load_tests/locustfile.py --headless -u 4 -r 4 -t 30s \\
        --host http://localhost:8000 GrpcStreamUser
        gRPC streaming, opted into by name (name both classes to run both).

`HttpGenerateUser` counts an HTTP error status or an "error" in the answer as a failure.
`GrpcStreamUser` reports, per request, besides the whole stream ("grpc" / "stream"):
"time_to_first_token" and "inter_token_latency" (ms, in the response-time columns) and
"tokens_per_s" (tokens per second of the request, in the response-time columns).
`SoakUser` (opted into by name; `python -m eagle_serve.tools.soak` runs it) mixes gRPC streams to
the ensemble and to spec_decode's cancellable direct path: ~10% are cancelled after a random
number of responses ("cancelled"), ~5% are intentionally bad ("bad request refused": success
means the server refused them with a message), the rest must finish ("stream").
Prompts: load_tests/prompts.jsonl, or the JSONL file named by env LOCUST_PROMPTS.
"""
import grpc.experimental.gevent as grpc_gevent

grpc_gevent.init_gevent()  # before any channel exists: gRPC's own threads must yield to gevent

import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from urllib.parse import urlparse  # noqa: E402

from locust import HttpUser, User, between, task  # noqa: E402

from eagle_serve.client import grpc_generate, request_body  # noqa: E402
from eagle_serve.paths import read_prompts  # noqa: E402

TIMEOUT_S = 300.0
PROMPTS_FILE = Path(os.environ.get("LOCUST_PROMPTS", Path(__file__).with_name("prompts.jsonl")))
PROMPTS = read_prompts(PROMPTS_FILE)


def random_request(rng: random.Random) -> tuple[str, dict]:
    """A prompt and parameters: short answers, greedy or sampled, server-default or set k."""
    params = {"max_tokens": rng.randint(4, 24),
              "num_speculative_tokens": rng.choice([None, 0, 2, 4])}
    if rng.random() < 0.4:
        params.update(temperature=rng.choice([0.7, 1.0]), top_p=rng.choice([0.9, 1.0]),
                      top_k=rng.choice([0, 50]), seed=rng.randrange(2**31))
    if rng.random() < 0.2:
        params["stop"] = ["."]
    return rng.choice(PROMPTS), params


def opted_in(class_name: str) -> bool:
    """Locust runs every user class unless classes are named on its command line."""
    return class_name in sys.argv[1:]


class HttpGenerateUser(HttpUser):
    """POST /v2/models/ensemble/generate: one JSON answer per request."""
    wait_time = between(0.05, 0.5)
    connection_timeout = 30.0
    network_timeout = TIMEOUT_S

    def on_start(self):
        self.rng = random.Random()

    @task
    def generate(self):
        prompt, params = random_request(self.rng)
        with self.client.post("/v2/models/ensemble/generate", json=request_body(prompt, **params),
                              name="/generate", catch_response=True, timeout=TIMEOUT_S) as response:
            if response.status_code != 200:
                response.failure(f"HTTP {response.status_code}: {response.text[:200]}")
                return
            body = response.json()
            if "error" in body:
                response.failure(body["error"])
            elif body.get("finish_reason") not in ("length", "stop"):
                response.failure(f"unfinished answer: finish_reason={body.get('finish_reason')!r}")


class _GrpcUser(User):
    """gRPC port: env GRPC_PORT, host: --host's; `report` fires a locust request event."""
    abstract = True
    wait_time = between(0.05, 0.5)

    def on_start(self):
        self.rng = random.Random()
        host = urlparse(self.host or "http://localhost").hostname or "localhost"
        self.url = f"{host}:{os.environ.get('GRPC_PORT', '8001')}"

    def report(self, name: str, value: float, length: int, exception=None):
        self.environment.events.request.fire(request_type="grpc", name=name, response_time=value,
                                             response_length=length, exception=exception,
                                             context={})


class GrpcStreamUser(_GrpcUser):
    """A gRPC stream per request."""
    weight = 1 if opted_in("GrpcStreamUser") else 0

    @task
    def stream(self):
        prompt, params = random_request(self.rng)
        error = None
        try:
            gen = grpc_generate(self.url, prompt, stream=True, timeout_s=TIMEOUT_S, **params)
            error = gen.error
        except Exception as exc:  # unreachable server, timeout
            self.report("stream", 0.0, 0, exc)
            return
        self.report("stream", gen.latency_s * 1000, len(gen.output_ids),
                    RuntimeError(error) if error else None)
        if error or gen.ttft_s is None:
            return
        self.report("time_to_first_token", gen.ttft_s * 1000, 0)
        if len(gen.output_ids) > 1:
            itl_s = (gen.times_s[-1] - gen.times_s[0]) / (len(gen.output_ids) - 1)
            self.report("inter_token_latency", itl_s * 1000, 0)
        self.report("tokens_per_s", len(gen.output_ids) / gen.latency_s, 0)


BAD_REQUESTS = [  # (params, the message the server must answer with)
    (dict(temperature=-1.0), "temperature must be a finite number >= 0"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(top_p=2.0), "top_p must be in (0, 1]"),
    (dict(num_speculative_tokens=99), "num_speculative_tokens must be in"),
    (dict(max_tokens=100_000), "exceeds max_model_len"),
]


def soak_request(rng: random.Random, url: str) -> tuple[str, Exception | None, int]:
    """One soak request -> (report name, failure or None, tokens received)."""
    prompt, params = random_request(rng)
    roll = rng.random()
    if roll < 0.05:
        bad, message = rng.choice(BAD_REQUESTS)
        gen = grpc_generate(url, prompt, model=rng.choice(["ensemble", "spec_decode"]),
                            stream=True, timeout_s=TIMEOUT_S, **{**params, **bad})
        ok = gen.error is not None and message in gen.error
        return "bad request refused", None if ok else RuntimeError(f"expected {message!r}, got {gen.error!r}"), 0
    if roll < 0.15:
        gen = grpc_generate(url, prompt, model="spec_decode", stream=True, timeout_s=TIMEOUT_S,
                            cancel_after_responses=rng.randint(1, 4), **{**params, "max_tokens": 32})
        ok = gen.error is None and gen.finish_reason in ("cancelled-by-client", "length", "stop")
        return "cancelled", None if ok else RuntimeError(f"{gen.error or gen.finish_reason}"), len(gen.output_ids)
    gen = grpc_generate(url, prompt, model=rng.choice(["ensemble", "spec_decode"]), stream=True,
                        timeout_s=TIMEOUT_S, **params)
    if gen.error is not None:
        return "stream", RuntimeError(gen.error), len(gen.output_ids)
    if gen.finish_reason not in ("length", "stop"):
        return "stream", RuntimeError(f"unfinished: {gen.finish_reason!r}"), len(gen.output_ids)
    return "stream", None, len(gen.output_ids)


class SoakUser(_GrpcUser):
    """Mixed gRPC streams with cancellations and intentional bad requests (see the top)."""
    weight = 1 if opted_in("SoakUser") else 0

    @task
    def stream(self):
        started = time.perf_counter()
        try:
            name, failure, tokens = soak_request(self.rng, self.url)
        except Exception as exc:  # unreachable server, client timeout
            name, failure, tokens = "stream", exc, 0
        self.report(name, (time.perf_counter() - started) * 1000, tokens, failure)
