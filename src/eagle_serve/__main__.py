"""`eagle-serve COMMAND` (or `python -m eagle_serve COMMAND`):

    generate --prompt ...   the engine in-process, no server: the text, then tokens, acceptance
                            length and tokens/s of each run, speculative (k > 0) against plain
    bench NAME [args]       a benchmark of eagle_serve.bench (NAME: see BENCHES)
    soak | gpu-check | lookup | repo-config | train [args]   the tools below
"""
from __future__ import annotations

import argparse
import runpy
import sys
import time


def generate(args) -> None:
    from eagle_serve import paths
    from eagle_serve.core.requests import SamplingParams
    from eagle_serve.core.tokenization import encode_prompt
    from eagle_serve.local import build_local_engine

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


BENCHES = {  # name -> what it measures
    "serve": "configs against a running server, interleaved per prompt group, with intervals",
    "matrix": "every serving case (streams, greedy / sampled) against plain decoding",
    "modes": "a running server against plain decoding and HF generate (and prompt lookup)",
    "features": "requests with logprobs, penalties, JSON schemas: speculative against plain",
    "long_prompts": "long prompts: cached and chunked prefill, other streams during one",
    "engine": "drafters A/B in process (no server), greedy or sampled, with concurrency",
    "forward": "the target's forward (linears, one-call stack) for 1-64 rows",
    "profile": "where a decode or verify forward spends its time",
    "ceiling": "the best speedup a head of given acceptance could reach on this machine",
    "rounds": "one round's time split between verify and drafting",
    "sampled": "sampled verification rules against each other",
    "fidelity": "how close a dtype's activations are to float64's",
}
TOOLS = {"soak": "eagle_serve.tools.soak", "gpu-check": "eagle_serve.tools.gpu_check",
         "lookup": "eagle_serve.spec.lookup", "repo-config": "eagle_serve.triton_backend.repo_config",
         "train": "eagle_serve.train"}


def run_module(module: str, prog: str, argv: list[str]) -> None:
    """Run `module` as `python -m` would, with `argv` as its arguments (and `prog` as its name
    in usage lines: runpy's alter_sys would put the module's file name there)."""
    saved = sys.argv
    sys.argv = [prog, *argv]
    try:
        runpy.run_module(module, run_name="__main__")
    finally:
        sys.argv = saved


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        if len(argv) < 2 or argv[1] not in BENCHES:
            width = max(map(len, BENCHES))
            listed = "\n".join(f"  {name:{width}}  {what}" for name, what in BENCHES.items())
            print(f"usage: eagle-serve bench NAME [args] (NAME --help for its own)\n\n{listed}")
            sys.exit(0 if len(argv) < 2 or argv[1] in ("-h", "--help") else 2)
        run_module(f"eagle_serve.bench.{argv[1]}", f"eagle-serve bench {argv[1]}", argv[2:])
        return
    if argv and argv[0] in TOOLS:
        run_module(TOOLS[argv[0]], f"eagle-serve {argv[0]}", argv[1:])
        return
    parser = argparse.ArgumentParser(prog="eagle-serve", epilog="also: bench NAME, " + ", ".join(TOOLS))
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
