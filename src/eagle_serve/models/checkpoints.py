"""Read and write EAGLE heads in the published layouts (docs/models.md lists them).

- EAGLE-1 (`yuhuili/EAGLE-*`): `fc.weight [H, 2H]` (+ `fc.bias`), `layers.{i}.*` (layer 0
  without input_layernorm), optional `embed_tokens.weight`; a Llama config (`qkv_bias` for
  Qwen2 heads).
- EAGLE-3 (`yuhuili/EAGLE3-*`, SpecForge exports): `fc.weight [H, n x H_target]`, `midlayer.*`
  (vLLM's naming: `layers.0.*`), `norm.weight`, `lm_head.weight [V_draft, H]` (absent = the
  target's LM head), `d2t` (target id = draft id + d2t[draft id]), `t2d`, optional
  `embed_tokens.weight`; config `LlamaForCausalLMEagle3` with `draft_vocab_size`,
  `target_hidden_size`, and the fused layers as `eagle_aux_hidden_state_layer_ids` (vLLM: the
  inputs of those layers) or SpecForge/SGLang's `eagle_config.eagle_aux_hidden_state_layer_ids`
  (the outputs of those layers, i.e. the inputs of the next ones).
- vLLM speculators (`speculators_model_type: eagle3`): the same weights under `layers.{i}.*`
  (multi-layer heads), the layer shape in `transformer_layer_config` (llama or qwen3 layers),
  `norm_before_residual` (vLLM's default when absent: true), `draft_vocab_size`,
  `target_hidden_size`, `eagle_aux_hidden_state_layer_ids`, `speculators_config`.

Biases, q/k norms and the number of layers are read from the weights; a head's own embedding
is used when it has one (vLLM does the same), else the target's. A head that does not fit its
target (hidden sizes, vocabulary, feature layers) is refused with the mismatch named.
Files: model.safetensors (or an index of shards) or pytorch_model.bin (read with
weights_only=True: no pickle code runs).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eagle_serve.cpu.matmul import round_linears_to_q8_0, use_cpu_linears, use_int8_activations
from eagle_serve.cpu.norm import use_cpu_norms
from eagle_serve.cpu.quant import int8_activations_run
from eagle_serve.kernels.layer_ops import fused_layers_run
from eagle_serve.models.cpu_stack import head_stack
from eagle_serve.models.drafter import Drafter
from eagle_serve.models.head_layer import HeadLayer
from eagle_serve.models.heads import HEAD_KINDS, EagleHead, HeadSpec
from eagle_serve.models.target import read_target_shape
from eagle_serve.settings import DRAFTER_WEIGHTS


class CheckpointError(ValueError):
    """A checkpoint that does not match the EAGLE layouts or the target."""


UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output", "parallel_drafting")


def read_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    if (folder / "model.safetensors").exists():
        return load_file(str(folder / "model.safetensors"))
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(str(folder / shard)).items()}
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


@dataclass
class HeadCheckpoint:
    """A head read from a folder: its kind, spec, weights under our names, own embedding."""
    kind: type[EagleHead]
    spec: HeadSpec
    state: dict[str, torch.Tensor]
    embed: torch.Tensor | None  # [V, H] the head's own embedding, if it ships one


def read_head(folder: str | Path, target_config) -> HeadCheckpoint:
    """target_config: the target's TargetShape or HF config (hidden_size, vocab_size,
    num_hidden_layers are read)."""
    folder = Path(folder)
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{folder}: config.json is missing")
    raw = json.loads(cfg_path.read_text())
    state = {k.removeprefix("model."): v for k, v in read_state_dict(folder).items()}
    state = {re.sub(r"^midlayer\.", "layers.0.", k): v for k, v in state.items()
             if not k.startswith("verifier_")}
    speculators = "speculators_model_type" in raw
    if speculators and raw["speculators_model_type"] != "eagle3":
        raise CheckpointError(f"{folder}: speculators model type '{raw['speculators_model_type']}' "
                              "is not supported (eagle3 is)")
    if "fc.weight" not in state or not any(k.startswith("layers.0.") for k in state):
        raise CheckpointError(f"{folder}: no fc.weight and layers.0 / midlayer weights; not an EAGLE head")
    kind = HEAD_KINDS[3 if speculators or "layers.0.hidden_norm.weight" in state else 1]
    layer_raw = raw.get("transformer_layer_config", {}) if speculators else raw
    _refuse_unsupported(folder, raw, layer_raw)
    spec = _spec(folder, raw, layer_raw, state, kind, target_config, speculators)
    embed = state.pop("embed_tokens.weight", None)
    problems = _fit_problems(spec, embed, target_config) + kind.fit_problems(spec, state, target_config)
    if problems:
        raise CheckpointError(f"{folder}: head does not fit the target: {'; '.join(problems)}")
    for key in kind.unused_keys:
        state.pop(key, None)
    return HeadCheckpoint(kind, spec, state, embed)


def _refuse_unsupported(folder: Path, raw: dict, layer_raw: dict) -> None:
    flags = [name for name in UNSUPPORTED_FLAGS if raw.get(name)]
    if raw.get("eagle_config", {}).get("use_aux_hidden_state") is False:
        flags.append("eagle_config.use_aux_hidden_state=false")
    if flags:
        raise CheckpointError(f"{folder}: head options not supported: {', '.join(flags)}")
    if layer_raw.get("model_type", "llama") not in ("llama", "qwen3") and "speculators_model_type" in raw:
        raise CheckpointError(f"{folder}: transformer_layer_config model type "
                              f"'{layer_raw['model_type']}' is not supported (llama, qwen3 are)")
    if layer_raw.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{folder}: hidden_act '{layer_raw['hidden_act']}' is not supported (silu is)")
    if "sliding_attention" in (layer_raw.get("layer_types") or []):
        raise CheckpointError(f"{folder}: sliding-window head layers are not supported")


def _spec(folder, raw, layer_raw, state, kind, target_config, speculators) -> HeadSpec:
    """What the config and the weights say the head is; biases, q/k norms and the number of
    layers from the weights, the rest of the layer shape from the config."""
    layer = HeadLayer.from_config(layer_raw)
    indices = {int(m.group(1)) for k in state if (m := re.match(r"layers\.(\d+)\.", k))}
    num_layers = len(indices)
    declared = layer_raw.get("num_hidden_layers", num_layers)
    if indices != set(range(num_layers)) or declared != num_layers:
        raise CheckpointError(f"{folder}: config num_hidden_layers is {declared} but the weights "
                              f"hold layers {sorted(indices)}")
    if state["fc.weight"].shape[0] != layer.hidden_size:
        raise CheckpointError(f"{folder}: fc.weight is {tuple(state['fc.weight'].shape)} but config "
                              f"hidden_size is {layer.hidden_size}")
    t_hidden = raw.get("target_hidden_size") or target_config.hidden_size
    if t_hidden != target_config.hidden_size:
        raise CheckpointError(f"{folder}: head does not fit the target: head expects target hidden size "
                              f"{t_hidden}, target has {target_config.hidden_size}")
    try:
        fields = kind.kind_fields(raw, state, target_config)
    except ValueError as error:
        raise CheckpointError(f"{folder}: {error}") from None
    has = lambda name: f"layers.0.{name}" in state  # noqa: E731
    return HeadSpec(layer=layer, target_hidden_size=t_hidden, num_layers=num_layers,
                    fc_bias="fc.bias" in state, qkv_bias=has("self_attn.q_proj.bias"),
                    o_bias=has("self_attn.o_proj.bias"), mlp_bias=has("mlp.gate_proj.bias"),
                    qk_norm=has("self_attn.q_norm.weight"),
                    norm_before_residual=bool(raw.get("norm_before_residual", speculators)), **fields)


def _fit_problems(spec: HeadSpec, embed, target) -> list[str]:
    """What does not fit the target whatever the head kind: embedding, feature layers."""
    vocab, hidden, problems = target.vocab_size, target.hidden_size, []
    if embed is None and spec.hidden_size != hidden:
        problems.append(f"head hidden size {spec.hidden_size} != target hidden size {hidden} and the "
                        "head has no embed_tokens of its own")
    if embed is not None and tuple(embed.shape) != (vocab, spec.hidden_size):
        problems.append(f"embed_tokens is {tuple(embed.shape)}, needs [target vocab {vocab}, {spec.hidden_size}]")
    if spec.feature_layers and not all(0 <= i < target.num_hidden_layers for i in spec.feature_layers):
        problems.append(f"feature layers {spec.feature_layers} outside the target's "
                        f"{target.num_hidden_layers} layers")
    return problems


def load_head(folder: str | Path, target_dir: str | Path, dtype=torch.float32,
              device="cpu") -> EagleHead:
    return _build(read_head(folder, read_target_shape(target_dir)), folder, dtype, device)


def _build(ckpt: HeadCheckpoint, folder, dtype, device) -> EagleHead:
    head = ckpt.kind(ckpt.spec)
    missing, unexpected = head.load_published(ckpt.state)
    if missing or unexpected:
        raise CheckpointError(f"{folder}: does not match the EAGLE-{head.version} layout; "
                              f"missing {missing[:6]}, unexpected {unexpected[:6]}")
    return head.to(device=device, dtype=dtype)


def load_drafter(folder: str | Path, target_dir: str | Path, *, dtype=torch.float32, device="cpu",
                 num_pages: int = 256, page_size: int = 16, weights: str = "trained") -> Drafter:
    """weights: "trained" (as the checkpoint holds them) or "q8_0": on a CPU that runs fp32
    through eagle_serve/kernels/cpu.cpp, the head's linears rounded to Q8_0 read a quarter of the bytes per
    draft step (drafts may change slightly; the target's verification keeps output exact);
    "q8_0_a8": also their inputs rounded to 8 bits per block of 32 (cpu_i8.cpp; "q8_0" where
    the CPU kernels do not run)."""
    if weights not in DRAFTER_WEIGHTS:
        raise ValueError(f"drafter weights must be one of {DRAFTER_WEIGHTS}, got {weights!r}")
    target_dir = Path(target_dir)
    ckpt = read_head(folder, read_target_shape(target_dir))
    head = _build(ckpt, folder, dtype, device)
    # the CPU's own kernels, unless the layers run on the GPU path's (tests force it on CPU)
    cpu = torch.device(device).type == "cpu" and not fused_layers_run(torch.empty(0, dtype=dtype))
    if cpu:
        use_cpu_linears(head)
        use_cpu_norms(head)
        if weights in ("q8_0", "q8_0_a8"):
            round_linears_to_q8_0(head)
        if weights == "q8_0_a8" and int8_activations_run():
            use_int8_activations(head.modules())
    embed = ckpt.embed
    if embed is None:
        embed = read_target_tensor(target_dir, ["model.embed_tokens.weight", "embed_tokens.weight"])
    if embed is None:
        raise CheckpointError(f"{target_dir}: no embed_tokens weight found")
    lm_head = None
    if head.uses_target_lm_head:
        lm_head = read_target_tensor(target_dir, ["lm_head.weight"])
        if lm_head is None:  # tied embeddings
            lm_head = read_target_tensor(target_dir, ["model.embed_tokens.weight", "embed_tokens.weight"])
    drafter = Drafter(head, embed.to(device), None if lm_head is None else lm_head.to(device),
                      num_pages=num_pages, page_size=page_size)
    if cpu:
        drafter.stack = head_stack(head, drafter.cache)  # None: the Python loop
    return drafter


def save_head(head: EagleHead, folder: str | Path, fmt: str = "safetensors",
              extra_config: dict | None = None, vocab_maps: bool = True) -> Path:
    """Write `head` in its kind's published layout (a one-layer EAGLE-3 head as `midlayer.*`)
    with a config.json. vocab_maps=False leaves out d2t/t2d (as heads whose vocabulary equals
    the target's do)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state, fields = head.published(vocab_maps)
    if head.num_layers == 1:
        state = {re.sub(r"^layers\.0\.", head.single_layer_name + ".", k): v for k, v in state.items()}
    config = head.spec.layer.to_dict() | {
        "architectures": [head.architecture], "num_hidden_layers": head.num_layers,
        "target_hidden_size": head.spec.target_hidden_size} | fields | (extra_config or {})
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    if fmt == "safetensors":
        save_file(state, str(folder / "model.safetensors"))
    else:
        torch.save(state, folder / "pytorch_model.bin")
    return folder
