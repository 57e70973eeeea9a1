"""The model repository's configs agree with each other and parse into settings."""
from __future__ import annotations

import sys

import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from eagle_serve import paths
from eagle_serve.settings import ServingSettings, read_settings, setting_names

REPO = paths.REPO_ROOT / "model_repository"


def parse(path):
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


def as_dict(path) -> dict:
    """A config file as the JSON dict Triton hands a model."""
    from google.protobuf import json_format
    return json_format.MessageToDict(parse(path), preserving_proto_field_name=True)


def test_the_gpu_config_of_each_model_differs_only_in_instance_kind_and_input_placement():
    for model in ("eagle_target", "eagle_drafter", "spec_decode"):
        cpu, gpu = parse(REPO / model / "config.pbtxt"), parse(REPO / model / "configs" / "gpu.pbtxt")
        assert [g.kind for g in gpu.instance_group] == [model_config_pb2.ModelInstanceGroup.KIND_GPU]
        assert gpu.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"].string_value == "no"
        del gpu.parameters["FORCE_CPU_ONLY_INPUT_TENSORS"]
        del gpu.instance_group[:], cpu.instance_group[:]
        assert cpu == gpu, model


def test_the_shipped_configs_serve_the_settings_defaults_and_restate_none():
    """One source of defaults, the dataclass: a config states only what differs from it (so no
    copy can drift); the shipped ones differ in nothing."""
    for config_file in ("config.pbtxt", "configs/gpu.pbtxt"):
        params = set(parse(REPO / "spec_decode" / config_file).parameters)
        assert params <= {"FORCE_CPU_ONLY_INPUT_TENSORS"}, config_file
    assert read_settings(REPO) == ServingSettings()


def test_every_setting_is_documented_for_users():
    text = (REPO.parent / "docs" / "configuration.md").read_text()
    assert [name for name in setting_names() if f"`{name}`" not in text] == []


def test_the_in_process_engine_runs_the_served_engine_config():
    from eagle_serve import paths
    from eagle_serve.local import build_local_engine
    from eagle_serve.settings import EngineConfig
    settings = read_settings(REPO)
    served = EngineConfig.from_settings(settings.resolved(paths.default_target_dir(), 4), (2,))
    local = build_local_engine(paths.default_target_dir(), None, dtype="float32", corpus=None)
    assert local.config == served
    assert served.drafting.num_speculative_tokens == ServingSettings().drafting.num_speculative_tokens


def test_the_model_sizes_the_kv_cache_and_the_context_unless_told():
    """The default target: 8192 tokens of context; 1 GiB of fp32 KV (30 layers, 3 KV heads of
    64) is 1456 pages of 16 (46,080 bytes a token)."""
    from eagle_serve import paths
    settings = read_settings(REPO).resolved(paths.default_target_dir(), 4)
    cache = settings.cache
    assert (settings.scheduler.max_model_len, cache.num_target_pages, cache.num_drafter_pages) == (8192, 1456, 1456)
    assert "23296 tokens" in settings.kv_summary()
    told = ServingSettings.of(max_model_len=4096, num_target_pages=100, kv_cache_gib=9.0)
    assert told.resolved(paths.default_target_dir(), 4).cache.num_target_pages == 100
    assert told.resolved(paths.default_target_dir(), 4).cache.num_drafter_pages == 100
    assert told.resolved(paths.default_target_dir(), 2).scheduler.max_model_len == 4096
    bf16 = ServingSettings().resolved(paths.default_target_dir(), 2)
    assert bf16.cache.num_target_pages == 2912  # half the bytes a token: 2^30 // (23,040 x 16)


def test_settings_parse_numbers_and_refuse_bad_ones_by_name():
    import pytest
    s = ServingSettings.from_parameters({"draft_min_prob": "0.05", "draft_expand_prob": "0.5",
                                         "max_running": "3"})
    assert (s.drafting.draft_min_prob, s.drafting.draft_expand_prob, s.scheduler.max_running) == (0.05, 0.5, 3)
    with pytest.raises(ValueError, match="draft_min_prob"):
        ServingSettings.from_parameters({"draft_min_prob": "often"})
    with pytest.raises(ValueError, match="draft_expand_prob must be in"):
        ServingSettings.from_parameters({"draft_expand_prob": "1.5"})
    with pytest.raises(ValueError, match="sampled_verify must be one of"):
        ServingSettings.from_parameters({"sampled_verify": "maybe"})


def test_every_ensemble_input_reaches_preprocess_and_spec_decode_with_the_same_type():
    """Clients (and perf_analyzer, which refuses an input the model does not declare) may send
    spec_decode what they send the ensemble; preprocess receives every ensemble input."""
    ensemble = parse(REPO / "ensemble" / "config.pbtxt")
    inputs = {i.name: (i.data_type, list(i.dims)) for i in ensemble.input}
    steps = {step.model_name: dict(step.input_map) for step in ensemble.ensemble_scheduling.step}
    for model in ("preprocess", "spec_decode"):
        declared = {i.name: (i.data_type, list(i.dims)) for i in parse(REPO / model / "config.pbtxt").input}
        sent = set(inputs) - ({"text_input", "apply_chat_template"} if model == "spec_decode" else set())
        assert inputs == {name: declared.get(name) for name in inputs}, model
        assert {k: v for k, v in steps[model].items() if k in sent} == {name: name for name in sent}, model
    tools = {"min_tokens", "min_length", "stop_words", "random_seed", "exclude_input_in_output",
             "return_num_input_tokens", "return_num_output_tokens", "frequency_penalty",
             "presence_penalty"}
    assert tools <= set(inputs) and all(i.optional for i in ensemble.input)


def test_the_chat_template_switch_parses_true_and_false_only():
    assert ServingSettings.from_parameters({"apply_chat_template": "false"}).api.apply_chat_template is False
    assert ServingSettings().api.apply_chat_template is True
    with pytest.raises(ValueError, match="apply_chat_template"):
        ServingSettings.from_parameters({"apply_chat_template": "sometimes"})


def test_single_instance_models_ask_for_one_instance():
    for model in ("eagle_target", "eagle_drafter", "spec_decode", "postprocess"):
        assert sum(g.count or 1 for g in parse(REPO / model / "config.pbtxt").instance_group) == 1


def test_a_gpu_instance_refuses_float64_and_auto_means_bfloat16_there():
    import torch

    from eagle_serve.models.dtypes import settings_dtype
    assert settings_dtype(ServingSettings.of(dtype="auto"), True, REPO) == torch.bfloat16
    assert settings_dtype(ServingSettings.of(dtype="float64"), False, REPO) == torch.float64
    with pytest.raises(ValueError, match="float64 runs on CPU instances only"):
        settings_dtype(ServingSettings.of(dtype="float64"), True, REPO)


def test_auto_is_float16_on_a_gpu_without_bfloat16_arithmetic(monkeypatch):
    import torch

    from eagle_serve.models.dtypes import torch_dtype
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for capability, want in (((7, 5), torch.float16), ((7, 0), torch.float16), ((8, 0), torch.bfloat16),
                             ((8, 9), torch.bfloat16), ((9, 0), torch.bfloat16), ((10, 0), torch.bfloat16)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a, c=capability: c)
        assert torch_dtype("auto", True) == want, capability
    assert torch_dtype("bfloat16", True) == torch.bfloat16  # asked for: as asked


def auto_completed(model: str, config_file: str, repo=REPO) -> dict:
    """What tritonserver's auto-complete step makes of a model config (as the JSON dict a model
    gets): the model.py's own auto_complete_config applied through the python backend's real
    ModelConfig class."""
    import importlib.util
    import json
    from unittest import mock

    utils = paths.tritonserver_dir() / "backends" / "python" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("pb_utils_for_test", utils)
    pb_utils = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pb_utils)
    model_file = repo / model / "1" / "model.py"
    spec = importlib.util.spec_from_file_location(f"{model}_model_for_test", model_file)
    model_py = importlib.util.module_from_spec(spec)
    with mock.patch.dict(sys.modules, {"triton_python_backend_utils": pb_utils}):
        spec.loader.exec_module(model_py)
    config = pb_utils.ModelConfig(json.dumps(as_dict(repo / model / config_file)))
    return model_py.TritonPythonModel.auto_complete_config(config).as_dict()


def auto_complete(model: str, config_file: str, repo=REPO) -> dict:
    """-> {name: data_type} of the features side (target outputs, drafter inputs)"""
    direction = "output" if model == "eagle_target" else "input"
    return {t["name"]: t["data_type"] for t in auto_completed(model, config_file, repo)[direction]}


def test_the_features_cross_bls_in_the_model_dtype_declared_alike_by_target_and_drafter(tmp_path):
    from eagle_serve.models.dtypes import dtype_name
    from eagle_serve.triton_backend.features import TRITON_TYPES
    from eagle_serve.triton_backend.repo_config import copy_repository

    cpu_auto = TRITON_TYPES[dtype_name("auto", False, paths.default_target_dir())]
    for config_file, want in (("config.pbtxt", cpu_auto), ("configs/gpu.pbtxt", "TYPE_BF16")):
        assert auto_complete("eagle_target", config_file)["hidden"] == want
        assert auto_complete("eagle_drafter", config_file)["features"] == want
    repo = copy_repository(REPO, tmp_path / "repo", ["spec_decode", "eagle_target", "eagle_drafter"],
                           {"spec_decode": {"dtype": "float64"}})
    assert auto_complete("eagle_target", "config.pbtxt", repo)["hidden"] == "TYPE_FP64"
    assert auto_complete("eagle_drafter", "config.pbtxt", repo)["features"] == "TYPE_FP64"
    with pytest.raises(ValueError, match="float64 runs on CPU instances only"):
        auto_complete("eagle_drafter", "configs/gpu.pbtxt", repo)


def test_auto_complete_imports_no_torch_where_the_dtype_is_named(tmp_path):
    """Triton runs each model's auto_complete_config in a process of its own at every start:
    with the dtype named, neither it nor any model.py's imports pay for torch."""
    import subprocess

    from eagle_serve.triton_backend.repo_config import copy_repository

    repo = copy_repository(REPO, tmp_path / "repo", ["spec_decode", "eagle_target", "eagle_drafter"],
                           {"spec_decode": {"dtype": "float64"}})
    script = f"""
import sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
import importlib.util
for model in ("eagle_target", "eagle_drafter", "spec_decode"):
    spec = importlib.util.spec_from_file_location(model, {str(repo)!r} + f"/{{model}}/1/model.py")
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
from eagle_serve.triton_backend.features import feature_type
assert feature_type({{}}, __import__("pathlib").Path({str(repo)!r})) == "TYPE_FP64"
assert "torch" not in sys.modules and "transformers" not in sys.modules, "torch imported"
"""
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert got.returncode == 0, got.stderr[-2000:]


def test_a_worker_refuses_to_load_without_the_features_its_auto_complete_declares():
    from eagle_serve.models.dtypes import settings_dtype
    from eagle_serve.triton_backend.features import require_features

    dtype = settings_dtype(read_settings(REPO), False, REPO)  # what a CPU worker runs
    for model, direction, name in (("eagle_target", "output", "hidden"),
                                   ("eagle_drafter", "input", "features")):
        require_features(auto_completed(model, "config.pbtxt"), direction, name, dtype)
        with pytest.raises(ValueError, match="--disable-auto-complete-config"):
            require_features(as_dict(REPO / model / "config.pbtxt"), direction, name, dtype)


def test_the_settings_come_from_the_config_triton_loads(monkeypatch):
    from eagle_serve.settings import CONFIG_NAME_ENV, settings_file
    monkeypatch.delenv(CONFIG_NAME_ENV, raising=False)
    assert settings_file(REPO) == REPO / "spec_decode" / "config.pbtxt"
    monkeypatch.setenv(CONFIG_NAME_ENV, "gpu")
    assert settings_file(REPO) == REPO / "spec_decode" / "configs" / "gpu.pbtxt"
    assert read_settings(REPO).scheduler.max_num_batched_tokens == 256
    monkeypatch.setenv(CONFIG_NAME_ENV, "no-such-config")  # Triton falls back to config.pbtxt too
    assert settings_file(REPO) == REPO / "spec_decode" / "config.pbtxt"
