"""Send one prompt to the `ensemble` model and print the answer as it arrives.

    python clients/generate.py "What is the capital of France?"                 # gRPC stream
    python clients/generate.py --protocol http --max-tokens 64 "Write a haiku"  # HTTP /generate
    python clients/generate.py --protocol http --stream "Hi"                    # HTTP SSE

The last line sums the answer up: tokens, acceptance length, tokens/s, time to first token.
Exits 1 when the server answers with an error or cannot be reached.
"""
from __future__ import annotations

import argparse
import json
import sys
import urllib.error

from eagle_serve.client import grpc_generate, http_generate, http_generate_stream

DEFAULT_URLS = {"grpc": "localhost:8001", "http": "localhost:8000"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the user message (or the raw prompt with --no-chat-template)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--url", help="host:port (default localhost:8001 for gRPC, :8000 for HTTP)")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="stream responses (default: on for gRPC, off for HTTP)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, help="0 = greedy (the server's default)")
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", help="a stop string (repeatable)")
    p.add_argument("--num-speculative-tokens", type=int,
                   help="draft tokens per round, 0 = plain decoding (default: the server's)")
    p.add_argument("--draft-topk", type=int,
                   help="children per draft-tree node, 1 = a chain (greedy only; default: the server's)")
    p.add_argument("--draft-depth", type=int, help="draft-tree depth (default: the server's)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--no-chat-template", action="store_true", help="send the prompt as it is")
    p.add_argument("--model", default="ensemble")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds")
    return p.parse_args(argv)


def generate(args: argparse.Namespace, on_chunk):
    url = args.url or DEFAULT_URLS[args.protocol]
    url = url.split("://", 1)[-1].rstrip("/")
    stream = args.stream if args.stream is not None else args.protocol == "grpc"
    params = dict(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                  top_k=args.top_k, seed=args.seed, stop=args.stop,
                  num_speculative_tokens=args.num_speculative_tokens,
                  draft_topk=args.draft_topk, draft_depth=args.draft_depth,
                  ignore_eos=args.ignore_eos or None, stream=stream,
                  apply_chat_template=False if args.no_chat_template else None)
    common = dict(model=args.model, timeout_s=args.timeout, **params)
    if args.protocol == "grpc":
        return grpc_generate(url, args.prompt, on_chunk=on_chunk, **common)
    if stream:
        return http_generate_stream(url, args.prompt, on_chunk=on_chunk, **common)
    return http_generate(url, args.prompt, **common)


def summary(gen) -> str:
    tokens = gen.counters.get("num_output_tokens", len(gen.output_ids))
    rate = tokens / gen.latency_s if gen.latency_s > 0 else 0.0
    accept = f"{gen.acceptance_length:.2f}" if gen.counters.get("num_draft_tokens") else "n/a"
    ttft = f"{gen.ttft_s * 1000:.0f} ms" if gen.ttft_s is not None else "n/a"
    return (f"[tokens {tokens} | acceptance length {accept} | {rate:.1f} tokens/s | "
            f"time to first token {ttft} | total {gen.latency_s:.2f} s | "
            f"finish {gen.finish_reason or '?'}]")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    streamed = []

    def on_chunk(text: str) -> None:
        streamed.append(text)
        print(text, end="", flush=True)
    try:
        gen = generate(args, on_chunk)
    except urllib.error.HTTPError as error:  # /generate_stream refused the request
        body = error.read().decode(errors="replace").removeprefix("data:").strip()
        try:
            body = json.loads(body).get("error", body)
        except ValueError:
            pass
        print(f"error: HTTP {error.code}: {body}", file=sys.stderr)
        return 1
    except Exception as error:  # refused connection, timeout, tritonclient's own exceptions
        print(f"error: {type(error).__name__}: {error}", file=sys.stderr)
        return 1
    if gen.error is not None:
        print(f"\nerror: {gen.error}", file=sys.stderr)
        return 1
    if not streamed:  # a single JSON answer: print it whole
        print(gen.text, end="")
    print("\n" + summary(gen), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
