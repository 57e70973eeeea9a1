"""Build an engine with in-process target and drafter (library use, tests, the CLI)."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, GenerationConfig

from eagle_serve.checkpoints import load_drafter
from eagle_serve.drafter import DraftPruning
from eagle_serve.engine import Engine, EngineConfig
from eagle_serve.target import TargetModel

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16}


def eos_token_ids(target_dir: str | Path) -> tuple[int, ...]:
    """EOS ids from generation_config.json (else config.json): an int or a list."""
    try:
        eos = GenerationConfig.from_pretrained(str(target_dir)).eos_token_id
    except OSError:
        eos = None
    if eos is None:
        from transformers import AutoConfig
        eos = AutoConfig.from_pretrained(str(target_dir)).eos_token_id
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def build_local_engine(target_dir: str | Path, drafter_dir: str | Path | None = None, *,
                       dtype: torch.dtype | str = torch.float32, device="cpu",
                       config: EngineConfig | None = None, pruning: DraftPruning = DraftPruning(),
                       **overrides) -> Engine:
    """Target (and drafter, if given) in this process, caches sized from the engine config;
    `pruning`: the drafter's confidence limits on greedy drafts."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = config or EngineConfig(eos_token_ids=eos_token_ids(target_dir))
    if overrides:
        from dataclasses import replace
        config = replace(config, **overrides)
    drafter = None
    if drafter_dir is not None:
        drafter = load_drafter(drafter_dir, target_dir, dtype=dtype, device=device,
                               num_pages=config.num_drafter_pages, page_size=config.page_size,
                               pruning=pruning)
    target = TargetModel(target_dir, dtype=dtype, device=device, num_pages=config.num_target_pages,
                         page_size=config.page_size,
                         feature_layers=drafter.feature_layers if drafter else None)
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    return Engine(target, drafter, config, tokenizer, device=device)
