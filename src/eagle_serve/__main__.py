"""`python -m eagle_serve generate --prompt ...`: the engine in-process, no server.

Prints the generated text, then tokens, acceptance length and tokens/s of each run, so
speculative (k > 0) and plain (k = 0) decoding can be compared on the same weights.
"""
from __future__ import annotations

import argparse
import time

from eagle_serve import paths
from eagle_serve.core.requests import SamplingParams
from eagle_serve.core.tokenization import encode_prompt
from eagle_serve.local import build_local_engine


def generate(args) -> None:
    target = paths.resolve_model_path(args.target)
    drafter = paths.resolve_model_path(args.drafter) if args.drafter != "none" else None
    engine = build_local_engine(target, drafter, dtype=args.dtype)
    ids = encode_prompt(engine.tokenizer, args.prompt, apply_chat_template=not args.raw)
    for k in args.k:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                seed=args.seed, num_speculative_tokens=k)
        start = time.perf_counter()
        result = engine.generate([ids], params)[0]
        seconds = time.perf_counter() - start
        print(engine.tokenizer.decode(result.token_ids, skip_special_tokens=True))
        print(f"[k={k}] tokens={len(result.token_ids)} acceptance_length={result.acceptance_length:.2f} "
              f"tokens/s={len(result.token_ids) / seconds:.1f} finish={result.finish_reason}\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m eagle_serve")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text in-process")
    g.add_argument("--prompt", required=True)
    g.add_argument("--target", default="default", help="HF folder (default: SmolLM2-135M-Instruct)")
    g.add_argument("--drafter", default="default-drafter", help="EAGLE head folder, or none")
    g.add_argument("--k", type=int, nargs="+", default=[0, 8],
                   help="speculative tokens per run (the served draft-tree shape applies)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--dtype", default="auto", help="auto = as the server (bfloat16 on CPUs with "
                   "native bf16 unless the target is GGUF blocks, else float32), or "
                   "float32|float64|bfloat16|float16")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    args = parser.parse_args(argv)
    generate(args)


if __name__ == "__main__":
    main()
