"""Read and write EAGLE heads in the published layouts (see reference/eagle.md).

EAGLE-1: `fc.weight [H, 2H]` (+ optional `fc.bias`), `layers.0.*` without input_layernorm.
EAGLE-3: `fc.weight [H, 3H_t]`, `midlayer.*` (or vLLM's `layers.0.*`), `norm.weight`,
`lm_head.weight [V_draft, H]`, optional `d2t` (int64, target = draft + d2t[draft]), `t2d`.
Files: model.safetensors or pytorch_model.bin (read with weights_only=True: no pickle code runs).
The target's embedding (and LM head, for EAGLE-1) are read from the target folder.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from eagle_serve.cpu_matmul import use_cpu_linears
from eagle_serve.drafter import Drafter, DrafterSpec, EagleHead
from eagle_serve.llama import eagle3_feature_layers


class CheckpointError(ValueError):
    """A checkpoint that does not match the EAGLE layouts or the target."""


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    if (folder / "pytorch_model.bin").exists():
        return torch.load(folder / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise CheckpointError(f"{folder}: no model.safetensors or pytorch_model.bin")


def read_target_tensor(target_dir: Path, names: list[str]) -> torch.Tensor | None:
    """The first of `names` found in the target's safetensors (sharded or not)."""
    index = target_dir / "model.safetensors.index.json"
    files = ([target_dir / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
             if index.exists() else sorted(target_dir.glob("*.safetensors")))
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            keys = set(handle.keys())
            for name in names:
                if name in keys:
                    return handle.get_tensor(name)
    return None


def _normalise_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Accept `model.` prefixes and vLLM's `layers.0.` naming of the EAGLE-3 midlayer."""
    state = {k.removeprefix("model."): v for k, v in state.items()}
    eagle3 = any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in state)
    if eagle3:
        state = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
                 for k, v in state.items()}
    return state


def inspect_checkpoint(folder: Path, state: dict[str, torch.Tensor],
                       target_config: LlamaConfig) -> DrafterSpec:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    raw = json.loads(cfg_path.read_text())
    raw.pop("architectures", None)
    config = LlamaConfig(**{k: v for k, v in raw.items() if k != "model_type"})
    config.num_hidden_layers = 1
    version = 3 if any(k.startswith("midlayer.") for k in state) else 1
    if "fc.weight" not in state:
        raise CheckpointError(f"{folder}: no fc.weight; not an EAGLE head")
    h, fc_in = state["fc.weight"].shape
    if h != config.hidden_size:
        raise CheckpointError(f"{folder}: fc.weight is {tuple(state['fc.weight'].shape)} but "
                              f"config hidden_size is {config.hidden_size}")
    t_hidden = raw.get("target_hidden_size") or target_config.hidden_size
    if version == 1 and (fc_in != 2 * h or h != target_config.hidden_size):
        raise CheckpointError(f"{folder}: EAGLE-1 fc.weight {tuple(state['fc.weight'].shape)} "
                              f"does not fit target hidden size {target_config.hidden_size}")
    if version == 3 and fc_in != 3 * t_hidden:
        raise CheckpointError(f"{folder}: EAGLE-3 fc.weight {tuple(state['fc.weight'].shape)} "
                              f"needs [H, 3 x {t_hidden}] for this target")
    draft_vocab = state["lm_head.weight"].shape[0] if version == 3 else target_config.vocab_size
    if version == 3 and "d2t" not in state and draft_vocab != target_config.vocab_size:
        raise CheckpointError(f"{folder}: draft vocab {draft_vocab} != target vocab "
                              f"{target_config.vocab_size} and no d2t map")
    layers = raw.get("eagle_aux_hidden_state_layer_ids") or (
        raw.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids"))
    feature_layers = (tuple(layers) if layers else eagle3_feature_layers(
        target_config.num_hidden_layers)) if version == 3 else None
    return DrafterSpec(version=version, config=config, target_hidden_size=t_hidden,
                       draft_vocab_size=draft_vocab, fc_bias="fc.bias" in state,
                       feature_layers=feature_layers)


def load_head(folder: str | Path, target_dir: str | Path, dtype=torch.float32,
              device="cpu") -> EagleHead:
    folder, target_dir = Path(folder), Path(target_dir)
    target_config = LlamaConfig.from_pretrained(str(target_dir))
    state = _normalise_keys(read_state_dict(folder))
    spec = inspect_checkpoint(folder, state, target_config)
    head = EagleHead(spec)
    for extra in ("embed_tokens.weight", "t2d", "lm_head.weight" if spec.version == 1 else ""):
        state.pop(extra, None)
    if spec.version == 3 and "d2t" not in state:
        state["d2t"] = torch.zeros(spec.draft_vocab_size, dtype=torch.int64)
    missing, unexpected = head.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith("rotary.")]
    if missing or unexpected:
        raise CheckpointError(f"{folder}: does not match the EAGLE-{spec.version} layout; "
                              f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    return head.to(device=device, dtype=dtype)


def load_drafter(folder: str | Path, target_dir: str | Path, *, dtype=torch.float32, device="cpu",
                 num_pages: int = 256, page_size: int = 16) -> Drafter:
    head = load_head(folder, target_dir, dtype, device)
    if torch.device(device).type == "cpu":
        use_cpu_linears(head)
    target_dir = Path(target_dir)
    embed = read_target_tensor(target_dir, ["model.embed_tokens.weight", "embed_tokens.weight"])
    if embed is None:
        raise CheckpointError(f"{target_dir}: no embed_tokens weight found")
    lm_head = None
    if head.version == 1:
        lm_head = read_target_tensor(target_dir, ["lm_head.weight"])
        lm_head = embed if lm_head is None else lm_head  # tied embeddings
    return Drafter(head, embed.to(device), None if lm_head is None else lm_head.to(device),
                   num_pages=num_pages, page_size=page_size)


def save_head(head: EagleHead, folder: str | Path, fmt: str = "safetensors",
              extra_config: dict | None = None, vocab_maps: bool = True) -> Path:
    """Write `head` in its published layout (EAGLE-1 or EAGLE-3) with a config.json.
    vocab_maps=False leaves out d2t/t2d (as heads whose vocabulary equals the target's do)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()
             if not k.startswith("rotary.")}
    if head.version == 3 and not vocab_maps:
        state.pop("d2t")
    elif head.version == 3:
        vocab = head.spec.config.vocab_size
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[torch.arange(head.spec.draft_vocab_size) + state["d2t"]] = True
        state["t2d"] = t2d
    config = head.spec.config.to_dict()
    config.update(architectures=["LlamaForCausalLMEagle3" if head.version == 3 else "LlamaForCausalLM"],
                  num_hidden_layers=1, target_hidden_size=head.spec.target_hidden_size,
                  **({"draft_vocab_size": head.spec.draft_vocab_size,
                      "eagle_aux_hidden_state_layer_ids": list(head.spec.feature_layers)}
                     if head.version == 3 else {}),
                  **(extra_config or {}))
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder


def head_config(target_config: LlamaConfig, draft_vocab_size: int | None = None) -> LlamaConfig:
    """A one-layer head config shaped like the target's layers."""
    cfg = LlamaConfig(**{k: v for k, v in target_config.to_dict().items()
                         if k not in ("model_type", "architectures", "quantization_config")})
    cfg.num_hidden_layers = 1
    if draft_vocab_size:
        cfg.draft_vocab_size = draft_vocab_size
    return cfg


def random_head(target_config: LlamaConfig, version: int, draft_vocab_size: int | None = None,
                fc_bias: bool = False, seed: int = 0, d2t: torch.Tensor | None = None,
                feature_layers: tuple[int, ...] | None = None) -> EagleHead:
    """A seeded random head (tests, and the placeholder drafter before training).
    feature_layers: the target layers (inputs of) an EAGLE-3 head fuses; default 2, L//2, L-3."""
    torch.manual_seed(seed)
    vocab = draft_vocab_size or target_config.vocab_size
    layers = (tuple(feature_layers) if feature_layers else
              eagle3_feature_layers(target_config.num_hidden_layers)) if version == 3 else None
    spec = DrafterSpec(version=version, config=head_config(target_config, vocab if version == 3 else None),
                       target_hidden_size=target_config.hidden_size,
                       draft_vocab_size=vocab if version == 3 else target_config.vocab_size,
                       fc_bias=fc_bias, feature_layers=layers)
    head = EagleHead(spec)
    for p in head.parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.02)
    if version == 3:
        head.d2t = d2t if d2t is not None else torch.zeros(vocab, dtype=torch.int64)
    return head


def write_random_eagle3_head(dest: Path, target_dir: Path, draft_vocab_size: int, seed: int = 0):
    """Seeded random EAGLE-3 head whose draft vocabulary is the first `draft_vocab_size` ids."""
    target_config = LlamaConfig.from_pretrained(str(target_dir))
    head = random_head(target_config, 3, draft_vocab_size, seed=seed)
    tmp = dest.with_name(dest.name + ".tmp")
    save_head(head, tmp)
    tmp.rename(dest)
    return dest
