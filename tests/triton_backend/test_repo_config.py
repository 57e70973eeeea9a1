"""Copying a model repository with selected models and overridden config parameters."""
import pytest
from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2

from eagle_serve import paths
from eagle_serve.triton_backend.repo_config import copy_repository, main, parse_assignments, quote, set_parameter

TARGET_CONFIG = """# the target
name: "eagle_target"
backend: "python"
max_batch_size: 0
parameters { key: "dtype" value: { string_value: "float32" } }
parameters: {
  key: "model_dir"
  value: { string_value: "default" }
}
"""

ENSEMBLE_STEP = """name: "ensemble"
platform: "ensemble"
ensemble_scheduling { step [ { model_name: "m" model_version: -1
  input_map { key: "dtype" value: "x" } output_map { key: "y" value: "dtype" } } ] }
"""


def parsed(text: str) -> model_config_pb2.ModelConfig:
    return text_format.Parse(text, model_config_pb2.ModelConfig())


def parameters(text: str) -> dict[str, str]:
    return {k: v.string_value for k, v in parsed(text).parameters.items()}


@pytest.fixture
def source(tmp_path):
    repo = tmp_path / "src"
    for name in ("eagle_target", "postprocess", "preprocess"):
        (repo / name / "1").mkdir(parents=True)
        (repo / name / "1" / "model.py").write_text("# model\n")
        (repo / name / "config.pbtxt").write_text(TARGET_CONFIG.replace("eagle_target", name))
    (repo / "eagle_target" / "configs").mkdir()
    (repo / "eagle_target" / "configs" / "gpu.pbtxt").write_text(TARGET_CONFIG)
    (repo / "eagle_target" / "1" / "__pycache__").mkdir()
    (repo / "notes").mkdir()  # not a model: no config.pbtxt
    return repo


def test_set_parameter_replaces_an_existing_value_and_keeps_the_rest_of_the_text():
    text = set_parameter(TARGET_CONFIG, "dtype", "float64")
    assert parameters(text) == {"dtype": "float64", "model_dir": "default"}
    assert text == TARGET_CONFIG.replace('"float32"', '"float64"')


def test_set_parameter_replaces_a_value_written_over_several_lines():
    text = set_parameter(TARGET_CONFIG, "model_dir", "/models/x")
    assert parameters(text) == {"dtype": "float32", "model_dir": "/models/x"}


def test_set_parameter_appends_a_missing_parameter():
    text = set_parameter(TARGET_CONFIG, "page_size", "16")
    assert parameters(text) == {"dtype": "float32", "model_dir": "default", "page_size": "16"}
    assert text.startswith(TARGET_CONFIG)


def test_set_parameter_quotes_values_so_they_parse_back_unchanged():
    value = 'a "quoted" \\path\\ with\nnewline'
    assert parameters(set_parameter(TARGET_CONFIG, "dtype", value))["dtype"] == value
    assert quote('say "hi"') == '"say \\"hi\\""'


def test_set_parameter_leaves_ensemble_maps_with_the_same_key_alone():
    text = set_parameter(ENSEMBLE_STEP, "dtype", "float64")
    config = parsed(text)
    assert config.ensemble_scheduling.step[0].input_map["dtype"] == "x"
    assert config.parameters["dtype"].string_value == "float64"


def test_copy_repository_copies_only_the_selected_models_with_overrides(source, tmp_path):
    dst = copy_repository(source, tmp_path / "dst", ["eagle_target", "postprocess"],
                          {"eagle_target": {"dtype": "float64"}})
    assert sorted(p.name for p in dst.iterdir()) == ["eagle_target", "postprocess"]
    for config in ("config.pbtxt", "configs/gpu.pbtxt"):
        assert parameters((dst / "eagle_target" / config).read_text())["dtype"] == "float64"
    assert parameters((dst / "postprocess" / "config.pbtxt").read_text())["dtype"] == "float32"
    assert (dst / "eagle_target" / "1" / "model.py").read_text() == "# model\n"
    assert not (dst / "eagle_target" / "1" / "__pycache__").exists()
    assert parameters((source / "eagle_target" / "config.pbtxt").read_text())["dtype"] == "float32"


def test_copy_repository_copies_every_model_by_default(source, tmp_path):
    dst = copy_repository(source, tmp_path / "dst")
    assert sorted(p.name for p in dst.iterdir()) == ["eagle_target", "postprocess", "preprocess"]


def test_copy_repository_refuses_unknown_models_and_overrides_of_models_not_copied(
        source, tmp_path):
    with pytest.raises(ValueError, match="not in"):
        copy_repository(source, tmp_path / "a", ["eagle_targt"])
    with pytest.raises(ValueError, match="not copied"):
        copy_repository(source, tmp_path / "b", ["postprocess"], {"eagle_target": {"k": "v"}})


def test_copy_of_the_real_repository_keeps_its_configs_valid(tmp_path):
    dst = copy_repository(paths.REPO_ROOT / "model_repository", tmp_path / "dst",
                          ["preprocess", "postprocess"],
                          {"postprocess": {"skip_special_tokens": "false"}})
    config = parsed((dst / "postprocess" / "config.pbtxt").read_text())
    assert config.parameters["skip_special_tokens"].string_value == "false"
    assert config.name == "postprocess"


def test_parse_assignments_groups_keys_by_model():
    assert parse_assignments(["eagle_target.dtype=float64", "eagle_target.x=a=b",
                              "postprocess.k="]) == {
        "eagle_target": {"dtype": "float64", "x": "a=b"}, "postprocess": {"k": ""}}
    with pytest.raises(ValueError, match="MODEL.KEY=VALUE"):
        parse_assignments(["dtype=float64"])


def test_the_command_line_copies_and_overrides(source, tmp_path, capsys):
    main([str(source), str(tmp_path / "dst"), "--models", "eagle_target",
          "--set", "eagle_target.dtype=float64"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "dst")
    text = (tmp_path / "dst" / "eagle_target" / "config.pbtxt").read_text()
    assert parameters(text)["dtype"] == "float64"
    with pytest.raises(SystemExit):
        main([str(source), str(tmp_path / "other"), "--set", "nonsense"])


def test_a_settings_file_overrides_like_set_and_set_wins_over_it(source, tmp_path):
    settings = tmp_path / "settings.conf"
    settings.write_text("# the ConfigMap of deploy/k8s\n\neagle_target.dtype=float64\n"
                        "  eagle_target.model_dir=/models/x  \n# eagle_target.dtype=bfloat16\n")
    main([str(source), str(tmp_path / "dst"), "--set-file", str(settings),
          "--set", "eagle_target.model_dir=/models/y"])
    for config in ("config.pbtxt", "configs/gpu.pbtxt"):
        text = (tmp_path / "dst" / "eagle_target" / config).read_text()
        assert parameters(text) == {"dtype": "float64", "model_dir": "/models/y"}


def test_the_shipped_kubernetes_settings_file_applies_to_the_real_repository(tmp_path):
    settings = paths.REPO_ROOT / "deploy" / "k8s" / "base" / "settings.conf"
    main([str(paths.REPO_ROOT / "model_repository"), str(tmp_path / "dst"), "--set-file", str(settings)])
    assert (tmp_path / "dst" / "spec_decode" / "config.pbtxt").read_text() == \
        (paths.REPO_ROOT / "model_repository" / "spec_decode" / "config.pbtxt").read_text()
