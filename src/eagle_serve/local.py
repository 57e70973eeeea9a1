"""Build an engine with in-process target and drafter (library use, tests, the CLI, eval)."""
from __future__ import annotations

from pathlib import Path

import torch

from eagle_serve.core.tokenization import eos_token_ids, text_tokenizer
from eagle_serve.engine import Engine
from eagle_serve.models.checkpoints import load_drafter
from eagle_serve.models.dtypes import torch_dtype
from eagle_serve.models.target import TargetModel
from eagle_serve.settings import EngineConfig, ModelSettings, ServingSettings, default_corpus_index, setting_sections
from eagle_serve.spec.lookup import load_corpus_index


def build_local_engine(target_dir: str | Path, drafter_dir: str | Path | None = None, *,
                       dtype: torch.dtype | str = "auto", device="cpu",
                       config: EngineConfig | None = None, corpus: str | Path | None = "default",
                       drafter_weights: str = ModelSettings.drafter_weights,
                       target_activations: str = ModelSettings.target_activations,
                       cuda_graphs: bool = ModelSettings.cuda_graphs, **overrides) -> Engine:
    """Target (and drafter, if given) in this process, caches sized from the engine config.
    config: default the served one (ServingSettings' defaults, the target's EOS ids);
    corpus: the lookup corpus index ("default": the drafter's, if it has one; None: none);
    drafter_weights: see checkpoints.load_drafter; target_activations, cuda_graphs: see
    target.TargetModel;
    overrides: settings to replace, by their config names (EngineConfig.with_values)."""
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype, torch.device(device).type == "cuda", Path(target_dir))
    if config is None:
        # resolved with the overrides in place: num_drafter_pages 0 then follows an overridden
        # num_target_pages, instead of what kv_cache_gib's default holds
        served = {k: v for k, v in overrides.items() if k in setting_sections(ServingSettings)}
        config = EngineConfig.from_settings(ServingSettings.of(**served).resolved(Path(target_dir), dtype.itemsize),
                                            eos_token_ids(target_dir))
    config = config.with_values(**overrides)
    drafter = None
    if drafter_dir is not None:
        drafter = load_drafter(drafter_dir, target_dir, dtype=dtype, device=device,
                               num_pages=config.cache.num_drafter_pages, page_size=config.cache.page_size,
                               weights=drafter_weights)
    target = TargetModel(target_dir, dtype=dtype, device=device, num_pages=config.cache.num_target_pages,
                         page_size=config.cache.page_size,
                         feature_layers=drafter.feature_layers if drafter else None,
                         activations=target_activations, cuda_graphs=cuda_graphs)
    tokenizer = text_tokenizer(target_dir)
    if corpus == "default":
        corpus = default_corpus_index(drafter_dir)
    return Engine(target, drafter, config, tokenizer, device=device,
                  corpus=load_corpus_index(Path(corpus), tokenizer) if corpus else None)
