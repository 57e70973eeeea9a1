"""Requests with logprobs and with penalties through the OpenAI endpoint of a running server,
speculative against plain decoding (num_speculative_tokens 0), interleaved:

    eagle-serve bench features --url http://localhost:9000 --json out/req.json --plot out/req.png

Each prompt runs every configuration in turn (the order rotating from prompt to prompt), so
drift of the machine falls on all of them alike. A configuration is a feature (none, logprobs
with 5 alternatives, penalties: frequency 0.5, presence 0.3, repetition 1.1) crossed with a
decoder (speculative: the server's default; plain); json_schema: a `response_format` schema
(answer, confidence, keywords), each answer ending where its grammar does. Reported per configuration: output tokens
per second of wall time over all prompts, and for each feature the speculative speedup and
whether every speculative answer equals the plain one (text, and logprobs within 1e-4).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from tqdm import tqdm

from eagle_serve import paths

ANSWER_SCHEMA = {"type": "object", "properties": {
    "answer": {"type": "string"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 5}},
    "required": ["answer", "confidence", "keywords"], "additionalProperties": False}
FEATURES = {"none": {}, "logprobs": {"logprobs": True, "top_logprobs": 5},
            "penalties": {"frequency_penalty": 0.5, "presence_penalty": 0.3,
                          "extra_body": {"repetition_penalty": 1.1}},
            "json_schema": {"response_format": {"type": "json_schema", "json_schema": {
                "name": "answer", "schema": ANSWER_SCHEMA, "strict": True}}}}
SOURCE_KEY = "eagle_spec_decode_accepted_tokens_by_source_total"
DECODERS = {"speculative": {}, "plain": {"num_speculative_tokens": 0}}


def request(client, model: str, prompt: str, max_tokens: int, feature: str, decoder: str) -> dict:
    kw = {k: v for k, v in FEATURES[feature].items() if k != "extra_body"}
    extra = {**FEATURES[feature].get("extra_body", {}), **DECODERS[decoder]}
    if feature != "json_schema":  # a JSON answer ends where its grammar does
        extra["ignore_eos"] = True
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                           max_tokens=max_tokens, temperature=0, extra_body=extra, **kw)
    seconds = time.perf_counter() - start
    choice = reply.choices[0]
    logprobs = [t.logprob for t in choice.logprobs.content] if choice.logprobs else None
    return {"seconds": seconds, "tokens": reply.usage.completion_tokens, "text": choice.message.content,
            "logprobs": logprobs}


def run(url: str, prompts: list[str], max_tokens: int, repeats: int) -> dict:
    import openai
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    configs = [(f, d) for f in FEATURES for d in DECODERS]
    request(client, model, prompts[0], 8, "none", "speculative")  # warm-up
    results = {f"{f}/{d}": [] for f, d in configs}
    jobs = [(r, i, p) for r in range(repeats) for i, p in enumerate(prompts)]
    sources: dict[str, float] = {}  # accepted drafts by source, of the speculative JSON requests
    for r, i, prompt in tqdm(jobs, desc="prompts", unit="prompt"):
        turn = (i + r) % len(configs)
        for f, d in configs[turn:] + configs[:turn]:
            before = by_source(url) if (f, d) == ("json_schema", "speculative") else None
            results[f"{f}/{d}"].append(request(client, model, prompt, max_tokens, f, d))
            if before is not None:
                time.sleep(0.5)  # the counters reach the metrics port every 0.25 s
                for k, v in by_source(url).items():
                    sources[k] = sources.get(k, 0.0) + v - before.get(k, 0.0)
    report = summarise(results, model, max_tokens, len(prompts), repeats)
    total = sum(sources.values())
    report["json_schema_accepted_share_by_source"] = {k: v / total for k, v in sources.items()} if total else {}
    return report


def by_source(url: str) -> dict[str, float]:
    """Accepted drafts by source so far (the server's metrics, through the OpenAI port)."""
    import re
    import urllib.request
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    found = re.findall(SOURCE_KEY + r'\{source="(\w+)"\} ([0-9.e+]+)', text)
    return {source: float(value) for source, value in found}


def summarise(results: dict, model: str, max_tokens: int, num_prompts: int, repeats: int) -> dict:
    rate = {name: sum(x["tokens"] for x in runs) / sum(x["seconds"] for x in runs) for name, runs in results.items()}
    per_token_ms = {name: 1000 * sum(x["seconds"] for x in runs) / sum(x["tokens"] for x in runs)
                    for name, runs in results.items()}
    features = {}
    for f in FEATURES:
        spec, plain = results[f"{f}/speculative"], results[f"{f}/plain"]
        same_text = all(a["text"] == b["text"] for a, b in zip(spec, plain))
        same_logprobs = all(a["logprobs"] is None or (len(a["logprobs"]) == len(b["logprobs"]) and all(
            abs(x - y) < 1e-4 for x, y in zip(a["logprobs"], b["logprobs"]))) for a, b in zip(spec, plain))
        features[f] = {"speedup": rate[f"{f}/speculative"] / rate[f"{f}/plain"],
                       "identical": same_text and same_logprobs}
    return {"model": model, "max_tokens": max_tokens, "prompts": num_prompts, "repeats": repeats,
            "tokens_per_s": rate, "ms_per_token": per_token_ms, "features": features,
            "logprobs_cost_ms_per_token_plain": per_token_ms["logprobs/plain"] - per_token_ms["none/plain"]}


def plot(report: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(FEATURES)
    for j, d in enumerate(DECODERS):
        values = [report["tokens_per_s"][f"{f}/{d}"] for f in names]
        ax.bar([i + 0.38 * j for i in range(len(names))], values, width=0.38, label=d)
    for i, f in enumerate(names):
        ax.text(i + 0.19, report["tokens_per_s"][f"{f}/speculative"], f"{report['features'][f]['speedup']:.2f}x",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks([i + 0.19 for i in range(len(names))], names)
    ax.set_ylabel("output tokens / s (bs 1, greedy)")
    ax.set_title(f"{report['model']}: speculative vs plain, by request feature")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://localhost:9000")
    parser.add_argument("--prompts", default=str(paths.REPO_ROOT / "clients" / "prompts" / "heldout.jsonl"))
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot")
    args = parser.parse_args(argv)
    lines = Path(args.prompts).read_text().splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()][:args.num_prompts]
    report = run(args.url.rstrip("/"), prompts, args.max_tokens, args.repeats)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    for name, value in report["tokens_per_s"].items():
        print(f"{name:24s} {value:7.1f} tok/s  {report['ms_per_token'][name]:6.2f} ms/token")
    for f, v in report["features"].items():
        print(f"{f:12s} speculative {v['speedup']:.2f}x plain, identical: {v['identical']}")
    print("json_schema: accepted drafts by source", report["json_schema_accepted_share_by_source"])
    if args.plot:
        plot(report, args.plot)


if __name__ == "__main__":
    main()
