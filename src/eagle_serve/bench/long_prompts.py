"""Long prompts through the OpenAI endpoint of a running server: prefix cache, chunked prefill,
the whole context. Three measurements, each printed, in the JSON and in the PNG:

    eagle-serve bench long_prompts --url http://localhost:9000 --json out/long.json --plot out/long.png

1. cached prefix: the time to first token of a chat whose ~1,400-token system prompt is cached,
   against the same text sent cold (a new `cache_salt` each pair: nothing cached), in turn;
2. one long prompt beside a stream: while a newcomer's ~1,700-token prompt prefills, the longest
   gap between another stream's chunks, against the newcomer's time to first token;
3. the whole context: a ~5,000-token prompt is answered.

The prompts are the target's own answers from the shipped training corpus (natural text),
decoded and cut to the wanted number of tokens with the target's tokenizer.
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics
import threading
import time
import uuid
from pathlib import Path

from eagle_serve import paths

CORPUS = paths.REPO_ROOT / "drafters" / "data" / "smollm2-extended" / "shard-0000.jsonl.gz"


def documents(tokenizer, sizes: list[int]) -> list[str]:
    """Texts of about `sizes` tokens each, all different, from the corpus's answers."""
    answers = []
    with gzip.open(CORPUS, "rt") as lines:
        for line in lines:
            answers.append(json.loads(line)["output_ids"])
            if sum(map(len, answers)) > sum(sizes) + 1000:
                break
    ids = [t for a in answers for t in a]
    texts, start = [], 0
    for n in sizes:
        texts.append(tokenizer.decode(ids[start:start + n], skip_special_tokens=True))
        start += n
    return texts


class Stream:
    """One streamed chat request; the time each content chunk arrived."""

    def __init__(self, client, model: str, messages: list[dict], max_tokens: int, **extra):
        self.times: list[float] = []
        self.sent = time.perf_counter()
        self.error: BaseException | None = None
        self._args = dict(model=model, messages=messages, max_tokens=max_tokens, stream=True,
                          extra_body={"ignore_eos": True, **extra})
        self._client = client
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Stream":
        self.sent = time.perf_counter()
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            for chunk in self._client.chat.completions.create(**self._args):
                if chunk.choices and chunk.choices[0].delta.content:
                    self.times.append(time.perf_counter())
        except BaseException as error:  # noqa: BLE001 (reported by the caller)
            self.error = error

    def wait(self) -> "Stream":
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self

    @property
    def ttft(self) -> float:
        return self.times[0] - self.sent


def cached_prefix(client, model: str, system: str, questions: list[str]) -> dict:
    cold, warm = [], []
    for i, question in enumerate(questions):
        salt = uuid.uuid4().hex  # nothing is cached under a new salt
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        cold.append(Stream(client, model, messages, 8, cache_salt=salt).start().wait().ttft)
        warm.append(Stream(client, model, messages, 8, cache_salt=salt).start().wait().ttft)
        print(f"  pair {i + 1}/{len(questions)}: cold {cold[-1] * 1000:.0f} ms, cached {warm[-1] * 1000:.0f} ms",
              flush=True)
    return {"cold_ttft_s": cold, "cached_ttft_s": warm,
            "ratio": statistics.median(warm) / statistics.median(cold)}


def long_beside_stream(client, model: str, document: str) -> dict:
    """A stream decoding, then a newcomer with a long prompt: the stream's gaps meanwhile."""
    running = Stream(client, model, [{"role": "user", "content": "Tell a long story about the sea."}],
                     400).start()
    while len(running.times) < 10 and running.thread.is_alive():
        time.sleep(0.01)
    newcomer = Stream(client, model, [{"role": "user", "content": document + "\n\nSummarize this."}], 8,
                      cache_salt=uuid.uuid4().hex).start().wait()
    running.wait()
    window = [t for t in running.times if newcomer.sent <= t <= newcomer.times[0]]
    edges = [newcomer.sent, *window, newcomer.times[0]]
    gap = max(b - a for a, b in zip(edges, edges[1:]))
    return {"newcomer_ttft_s": newcomer.ttft, "longest_gap_s": gap, "ratio": gap / newcomer.ttft,
            "stream_chunk_times_s": [t - running.sent for t in running.times],
            "newcomer_window_s": [newcomer.sent - running.sent, newcomer.times[0] - running.sent]}


def whole_context(client, model: str, document: str) -> dict:
    start = time.perf_counter()
    reply = client.chat.completions.create(model=model, max_tokens=16, messages=[
        {"role": "user", "content": document + "\n\nWhat is this text about?"}])
    return {"prompt_tokens": reply.usage.prompt_tokens, "completion_tokens": reply.usage.completion_tokens,
            "seconds": time.perf_counter() - start, "answer": reply.choices[0].message.content}


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    cache = results["cached_prefix"]
    left.plot([t * 1000 for t in cache["cold_ttft_s"]], "o-", label="cold (new salt)")
    left.plot([t * 1000 for t in cache["cached_ttft_s"]], "o-", label="prefix cached")
    left.set(xlabel="pair", ylabel="time to first token (ms)",
             title=f"~{results['system_tokens']}-token system prompt: cached/cold {cache['ratio']:.2f}x")
    left.legend()
    beside = results["long_beside_stream"]
    times = beside["stream_chunk_times_s"]
    right.plot(times[1:], [(b - a) * 1000 for a, b in zip(times, times[1:])], ".-", label="stream's gaps")
    right.axvspan(*beside["newcomer_window_s"], alpha=0.2, color="tab:red",
                  label=f"newcomer's {results['newcomer_tokens']}-token prefill")
    right.set(xlabel="time since the stream started (s)", ylabel="gap between chunks (ms)",
              title=f"longest gap / newcomer's TTFT {beside['ratio']:.2f}")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    import openai

    from eagle_serve.core.tokenization import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://localhost:9000")
    parser.add_argument("--model", default=paths.DEFAULT_TARGET_NAME)
    parser.add_argument("--tokenizer", default=str(paths.default_target_dir()))
    parser.add_argument("--system-tokens", type=int, default=1400)
    parser.add_argument("--newcomer-tokens", type=int, default=1700)
    parser.add_argument("--long-tokens", type=int, default=5000)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=600)
    system, newcomer, long_doc = documents(load_tokenizer(args.tokenizer),
                                           [args.system_tokens, args.newcomer_tokens, args.long_tokens])
    questions = paths.read_prompts(paths.HELDOUT_PROMPTS)[:args.pairs]
    results = {"system_tokens": args.system_tokens, "newcomer_tokens": args.newcomer_tokens}
    print(f"1. a cached {args.system_tokens}-token system prompt against the same text cold", flush=True)
    results["cached_prefix"] = cached_prefix(client, args.model, system, questions)
    print(f"   cached / cold time to first token (medians): {results['cached_prefix']['ratio']:.2f}", flush=True)
    print(f"2. a {args.newcomer_tokens}-token prompt arriving beside a stream", flush=True)
    results["long_beside_stream"] = beside = long_beside_stream(client, args.model, newcomer)
    print(f"   the stream's longest gap {beside['longest_gap_s'] * 1000:.0f} ms, the newcomer's time to "
          f"first token {beside['newcomer_ttft_s'] * 1000:.0f} ms: {beside['ratio']:.2f}", flush=True)
    print(f"3. a {args.long_tokens}-token prompt", flush=True)
    results["whole_context"] = whole = whole_context(client, args.model, long_doc)
    print(f"   answered: {whole['prompt_tokens']} prompt tokens, {whole['completion_tokens']} tokens out "
          f"in {whole['seconds']:.1f} s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
