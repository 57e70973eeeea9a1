"""The features tensor of eagle_target (output `hidden`) and eagle_drafter (input `features`),
declared by each model's `auto_complete_config` in the model dtype its settings give here.

Triton runs `auto_complete_config` in a stub process of its own, which imports model.py and
exits, before the model's instance stub imports it again: so model.py imports this module (the
settings and the dtype names: no torch unless `auto` must ask the GPU or read the target's
weights, no transformers) and its worker only inside `initialize`, which keeps the model's
imports off that process at every server start (docs/performance.md, "Start-up").
"""
from __future__ import annotations

from pathlib import Path

from eagle_serve.models.dtypes import settings_dtype_name
from eagle_serve.settings import read_settings

TARGET = ("output", "hidden")  # (direction, name) of each model's features tensor
DRAFTER = ("input", "features")

TRITON_TYPES = {"bfloat16": "TYPE_BF16", "float16": "TYPE_FP16", "float32": "TYPE_FP32",
                "float64": "TYPE_FP64"}  # torch dtype name -> Triton type


def feature_type(model_config: dict, repo: Path) -> str:
    """The Triton type of the features for a model of `repo` with this config: its settings'
    dtype on the config's instance kind."""
    on_gpu = any(g.get("kind") == "KIND_GPU" for g in model_config.get("instance_group", []))
    return TRITON_TYPES[settings_dtype_name(read_settings(repo), on_gpu, repo)]


def declare_features(auto_config, direction: str, name: str, model_file: str):
    """auto_complete_config of eagle_target (output `hidden`) and eagle_drafter (input
    `features`): declares the [-1, -1] features tensor in the model dtype. `model_file` is the
    model.py (<repo>/<model>/1/model.py), which locates the repository."""
    repo = Path(model_file).resolve().parents[2]
    tensor = {"name": name, "data_type": feature_type(auto_config.as_dict(), repo),
              "dims": [-1, -1]}
    (auto_config.add_output if direction == "output" else auto_config.add_input)(tensor)
    return auto_config


def require_features(model_config: dict, direction: str, name: str, dtype) -> None:
    """Refuse to load when the features tensor is missing or not of the worker's `dtype`, the
    type `declare_features` gives (e.g. tritonserver ran with --disable-auto-complete-config)."""
    declared = {t["name"]: t.get("data_type") for t in model_config.get(direction, [])}
    want = TRITON_TYPES[str(dtype).removeprefix("torch.")]  # dtype: a torch dtype
    if declared.get(name) != want:
        raise ValueError(
            f"{model_config.get('name')}: {direction} '{name}' must be declared {want} (the model "
            f"dtype), found {declared.get(name)}; model.py declares it when tritonserver "
            f"auto-completes configs: do not pass --disable-auto-complete-config")
