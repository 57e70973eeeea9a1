"""Where a round's time goes, per draft shape: Triton's per-model metrics around a run.

    eagle-serve bench rounds --prompts clients/prompts/heldout.jsonl --num-prompts 10 \
        --configs 0 1 2 6x3x3

For each config (as in speedup_curve.py: `K` or `KxTOPKxDEPTH`) the prompts are sent one at a
time (bs 1, greedy, or sampled with --temperature and a seed per prompt); the deltas of `nv_inference_*_duration_us` of `eagle_target` and
`eagle_drafter` give each model's time per call (request = as Triton saw it; infer = its
execute()), next to the client's time per round. What is left of a round after the two calls
is spec_decode's own work and the BLS hops. Configs run one after another, so slow drift of
the machine is not cancelled out: compare shapes with speedup_curve.py, use this for the split.
"""
from __future__ import annotations

import argparse
import re

from eagle_serve.bench.serve import parse_config
from eagle_serve.client import grpc_generate, metrics
from eagle_serve.core.requests import acceptance_length
from eagle_serve.paths import read_prompts

METRIC = re.compile(r'(nv_inference_(?:compute_infer_duration_us|request_duration_us|count))'
                    r'\{model="(\w+)"')


def model_metrics(url: str) -> dict[tuple[str, str], float]:
    """{(metric, model): value} of Triton's per-model counters used here."""
    return {(m.group(1), m.group(2)): value for key, value in metrics(url).items()
            if (m := METRIC.match(key))}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=["0", "1", "2"])
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--metrics-url", default="localhost:8002")
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args(argv)
    sampling = ({"temperature": args.temperature} if args.temperature > 0 else {})
    prompts = read_prompts(args.prompts)[:args.num_prompts]
    for c in args.configs:  # warm-up, untimed
        grpc_generate(args.url, prompts[0], max_tokens=8, **parse_config(c))
    for c in args.configs:
        before, tokens, seconds, rounds, accepted = model_metrics(args.metrics_url), 0, 0.0, 0, 0
        for i, prompt in enumerate(prompts):
            seed = {"seed": i} if sampling else {}
            gen = grpc_generate(args.url, prompt, max_tokens=args.max_tokens, **sampling, **seed,
                                **parse_config(c))
            tokens, seconds = tokens + len(gen.output_ids), seconds + gen.latency_s
            rounds += gen.counters.get("num_rounds", 0)
            accepted += gen.counters.get("num_accepted_tokens", 0)
        after = model_metrics(args.metrics_url)
        d = {k: v - before.get(k, 0.0) for k, v in after.items()}
        print(f"{c:>8}: {tokens / seconds:6.2f} tokens/s  tau {acceptance_length(accepted, rounds):.2f}  "
              f"{1e3 * seconds / max(rounds, 1):5.1f} ms/round")
        for model in ("eagle_target", "eagle_drafter"):
            n = d.get(("nv_inference_count", model), 0.0)
            if n:
                request = d[("nv_inference_request_duration_us", model)] / n / 1e3
                infer = d[("nv_inference_compute_infer_duration_us", model)] / n / 1e3
                print(f"          {model}: {n:.0f} calls, request {request:.2f} ms, infer {infer:.2f} ms")


if __name__ == "__main__":
    main()
