"""How far the default target on 8-bit activations (`target_activations` int8) is from its fp32
forward, in process (no server):

    eagle-serve bench fidelity --prompts clients/prompts/heldout.jsonl [--max-tokens 128]

Each prompt's fp32 greedy answer (plain decoding) is read back by each forward at once
(teacher-forced): the share of answer positions where its next-token argmax agrees with fp32's,
the mean KL(fp32 || it) of the next-token distributions, and how many of its own greedy answers
equal the fp32 ones token for token; for int8, and for scale for bf16 (the same weights in
bf16, what a GPU serves). docs/performance.md quotes it.
"""
from __future__ import annotations

import argparse
from collections import Counter

import torch
from tqdm import tqdm

from eagle_serve import paths
from eagle_serve.core.interfaces import RaggedBatch
from eagle_serve.core.kv_pages import PagePool
from eagle_serve.core.requests import SamplingParams
from eagle_serve.core.tokenization import encode_prompt, load_tokenizer
from eagle_serve.local import build_local_engine


def read_back(target, ids: list[int]) -> torch.Tensor:
    """The target's logits at every position of `ids` (one prefill) -> [len(ids), V] fp32"""
    pool, table = PagePool(len(ids) // 16 + 2, 16), []
    pool.grow(table, len(ids))
    n = len(ids)
    batch = RaggedBatch(torch.tensor(ids), torch.arange(n), torch.tensor([0, n]), torch.tensor([n]),
                        torch.tensor([table]), torch.tensor([pool.slot(table, p) for p in range(n)]))
    with torch.inference_mode():
        return target.logits(batch, torch.arange(n)).float()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", required=True)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    target_dir = paths.default_target_dir()
    engines = {"fp32": build_local_engine(target_dir, None, dtype="float32"),
               "int8": build_local_engine(target_dir, None, dtype="float32", target_activations="int8"),
               "bf16": build_local_engine(target_dir, None, dtype="bfloat16")}
    tokenizer = load_tokenizer(target_dir)
    params = SamplingParams(max_tokens=args.max_tokens, num_speculative_tokens=0, ignore_eos=True)
    agree, kl, same, positions = Counter(), Counter(), Counter(), 0
    prompts = [encode_prompt(tokenizer, p) for p in paths.read_prompts(args.prompts)]
    for prompt in tqdm(prompts, desc="prompts"):
        answers = {a: e.generate([prompt], params)[0].token_ids for a, e in engines.items()}
        ids = prompt + answers["fp32"]
        logits = {a: read_back(e.target, ids)[len(prompt) - 1:-1] for a, e in engines.items()}
        positions += len(logits["fp32"])
        reference = logits["fp32"].log_softmax(-1)
        for a in ("int8", "bf16"):
            same[a] += answers[a] == answers["fp32"]
            agree[a] += (logits[a].argmax(-1) == reference.argmax(-1)).sum().item()
            kl[a] += torch.nn.functional.kl_div(logits[a].log_softmax(-1), reference, log_target=True,
                                                reduction="sum").item()
    for a in ("int8", "bf16"):
        print(f"{a}: next-token argmax = fp32's at {agree[a]}/{positions} answer positions "
              f"({agree[a] / positions:.4f}); mean KL(fp32 || {a}) {kl[a] / positions:.5f} nats; "
              f"greedy answers = fp32's {same[a]}/{len(prompts)}")


if __name__ == "__main__":
    main()
