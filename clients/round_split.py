"""Where a round's time goes, per draft shape: Triton's per-model metrics around a run.

    python clients/round_split.py --prompts clients/prompts/heldout.jsonl --num-prompts 10 \
        --configs 0 1 2 6x3x3

For each config (as in speedup_curve.py: `K` or `KxTOPKxDEPTH`) the prompts are sent one at a
time (bs 1, greedy); the deltas of `nv_inference_*_duration_us` of `eagle_target` and
`eagle_drafter` give each model's time per call (request = as Triton saw it; infer = its
execute()), next to the client's time per round. What is left of a round after the two calls
is spec_decode's own work and the BLS hops. Configs run one after another, so slow drift of
the machine is not cancelled out: compare shapes with speedup_curve.py, use this for the split.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from eagle_serve.client import grpc_generate  # noqa: E402
from speedup_curve import parse_config  # noqa: E402

METRIC = re.compile(r'(nv_inference_(?:compute_infer_duration_us|request_duration_us|count))'
                    r'\{model="(\w+)".*\} (\S+)')


def metrics(url: str) -> dict:
    text = urllib.request.urlopen(f"http://{url}/metrics").read().decode()
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in map(METRIC.match, text.splitlines()) if m}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", required=True)
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--configs", nargs="+", default=["0", "1", "2"])
    p.add_argument("--url", default="localhost:8001")
    p.add_argument("--metrics-url", default="localhost:8002")
    args = p.parse_args(argv)
    prompts = [json.loads(line)["prompt"] for line in Path(args.prompts).read_text().splitlines()
               if line.strip()][:args.num_prompts]
    for c in args.configs:  # warm-up, untimed
        grpc_generate(args.url, prompts[0], max_tokens=8, **parse_config(c))
    for c in args.configs:
        before, tokens, seconds, rounds = metrics(args.metrics_url), 0, 0.0, 0
        for prompt in prompts:
            gen = grpc_generate(args.url, prompt, max_tokens=args.max_tokens, **parse_config(c))
            tokens, seconds = tokens + len(gen.output_ids), seconds + gen.latency_s
            rounds += gen.counters.get("num_rounds", 0)
        after = metrics(args.metrics_url)
        d = {k: v - before.get(k, 0.0) for k, v in after.items()}
        print(f"{c:>8}: {tokens / seconds:6.2f} tokens/s  tau {tokens / max(rounds, 1):.2f}  "
              f"{1e3 * seconds / max(rounds, 1):5.1f} ms/round")
        for model in ("eagle_target", "eagle_drafter"):
            n = d.get(("nv_inference_count", model), 0.0)
            if n:
                request = d[("nv_inference_request_duration_us", model)] / n / 1e3
                infer = d[("nv_inference_compute_infer_duration_us", model)] / n / 1e3
                print(f"          {model}: {n:.0f} calls, request {request:.2f} ms, infer {infer:.2f} ms")


if __name__ == "__main__":
    main()
