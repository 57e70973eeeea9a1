"""deploy/: the Kubernetes manifests rendered by the real `kubectl kustomize` (both overlays) and
validated against the Kubernetes schemas (kubernetes-validate, strict), what ties them together
(labels, ports, flags, metric names), and the Grafana dashboard's queries parsed as PromQL.
That the dashboard's metrics are exported is checked against live servers in test_replicas.py.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml
from grafana import dashboard, dashboard_queries, metric_names

from eagle_serve import paths
from eagle_serve.server.replicas import ROUTER_FLAGS

DEPLOY = paths.REPO_ROOT / "deploy"
KUBECTL = Path(sys.executable).parent / "kubectl"
OVERLAYS = ("gpu", "cpu")
K8S_VERSION = "1.37.0"
# The Prometheus Operator's CRD has no schema in kubernetes-validate: its required shape here
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
                     "selector": {"type": "object", "properties": {"matchLabels": {"type": "object"}}},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "required": ["port"], "additionalProperties": False,
                         "properties": {"port": {"type": "string"}, "interval": {"type": "string"}}}}}}}}


def render(overlay: str) -> list[dict]:
    out = subprocess.run([str(KUBECTL), "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                         capture_output=True, text=True, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def manifests(request) -> dict[tuple[str, str], dict]:
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in render(request.param)} | {
        ("overlay", request.param): {}}


def overlay_of(manifests) -> str:
    return next(name for kind, name in manifests if kind == "overlay")


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def test_both_overlays_render_and_validate_strictly_against_the_kubernetes_schemas(manifests):
    kinds = set()
    for (kind, name), doc in manifests.items():
        if kind == "overlay":
            continue
        kinds.add(kind)
        if kind == "ServiceMonitor":
            jsonschema.validate(doc, SERVICE_MONITOR)
        else:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor",
            "ConfigMap", "ServiceAccount", "Role", "RoleBinding"} <= kinds


def test_the_schema_check_rejects_a_broken_manifest(manifests):
    broken = json.loads(json.dumps(manifests[("Deployment", "eagle-serve")]))
    broken["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)


def test_the_router_discovers_the_server_pods_by_label_with_the_flags_of_make_replicas(manifests):
    server, router = manifests[("Deployment", "eagle-serve")], manifests[("Deployment", "eagle-router")]
    args = container(router, "router")["args"]
    selector = args[args.index("--selector") + 1:]
    selector = selector[:next((i for i, a in enumerate(selector) if a.startswith("--")), len(selector))]
    pod_labels = server["spec"]["template"]["metadata"]["labels"]
    assert selector and all(pod_labels.get(k) == v for k, v in (s.split("=", 1) for s in selector))
    assert "--service-discovery" in args
    openai_port = next(p["containerPort"] for p in container(server, "server")["ports"] if p["name"] == "openai")
    assert args[args.index("--service-discovery-port") + 1] == str(openai_port)
    start = args.index(ROUTER_FLAGS[0])
    assert args[start:start + len(ROUTER_FLAGS)] == ROUTER_FLAGS
    env = {e["name"]: e.get("value") for e in container(router, "router")["env"]}
    assert env["VLLM_ROUTER_TOKENIZER"] == f"/opt/eagle-serve/.cache/models/{paths.DEFAULT_TARGET_NAME}"
    assert "ENV EAGLE_CACHE=/opt/eagle-serve/.cache" in (paths.REPO_ROOT / "docker" / "Dockerfile").read_text()
    # the router may watch the pods of its namespace
    binding = manifests[("RoleBinding", "eagle-router")]
    role = manifests[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]
    assert binding["subjects"][0]["name"] == router["spec"]["template"]["spec"]["serviceAccountName"]
    assert any("pods" in r["resources"] and {"list", "watch"} <= set(r["verbs"]) for r in role["rules"])


def test_the_autoscaler_scales_the_server_on_the_waiting_metric_the_adapter_serves(manifests):
    hpa = manifests[("HorizontalPodAutoscaler", "eagle-serve")]
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "eagle-serve"}
    (metric,) = hpa["spec"]["metrics"]
    adapter = yaml.safe_load((DEPLOY / "k8s" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = adapter["rules"]["custom"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert rule["seriesQuery"].startswith("eagle_requests_waiting{")
    pdb = manifests[("PodDisruptionBudget", "eagle-serve")]
    assert pdb["spec"]["selector"]["matchLabels"] == \
        manifests[("Deployment", "eagle-serve")]["spec"]["selector"]["matchLabels"]


def test_the_server_pod_probes_its_ports_drains_before_it_stops_and_builds_its_repository(manifests):
    server = manifests[("Deployment", "eagle-serve")]
    pod = server["spec"]["template"]["spec"]
    main = container(server, "server")
    ports = {p["name"] for p in main["ports"]}
    for probe in ("startupProbe", "readinessProbe"):
        assert main[probe]["httpGet"] == {"path": "/health", "port": "openai"} and "openai" in ports
    assert main["livenessProbe"]["exec"]["command"][:3] == ["python3", "-m", "eagle_serve.server.health"]
    drain = main["lifecycle"]["preStop"]["exec"]["command"]
    assert drain[:4] == ["python3", "-m", "eagle_serve.server.health", "--drain"]
    assert float(drain[4]) < pod["terminationGracePeriodSeconds"]
    (init,) = pod["initContainers"]
    assert init["command"][:3] == ["python3", "-m", "eagle_serve.triton_backend.repo_config"]
    assert f"--model-repository={init['command'][4]}" in main["args"]
    settings = next(v for v in pod["volumes"] if v["name"] == "settings")["configMap"]["name"]
    assert ("ConfigMap", settings) in manifests  # the generated name, hash and all
    keys = {e["valueFrom"]["secretKeyRef"]["key"] for e in main["env"] if "valueFrom" in e}
    assert keys == {"admin-key", "api-keys"}


def test_the_gpu_overlay_asks_one_gpu_and_the_gpu_configs_and_the_cpu_overlay_neither(manifests):
    main = container(manifests[("Deployment", "eagle-serve")], "server")
    env = {e["name"]: e.get("value") for e in main["env"]}
    if overlay_of(manifests) == "gpu":
        assert main["resources"]["limits"]["nvidia.com/gpu"] == 1 and env["MODEL_CONFIG_NAME"] == "gpu"
    else:
        assert "nvidia.com/gpu" not in json.dumps(main["resources"]) and "MODEL_CONFIG_NAME" not in env


def test_the_service_monitor_scrapes_named_ports_of_the_services_it_selects(manifests):
    monitor = manifests[("ServiceMonitor", "eagle-serve")]
    selected = [doc for (kind, _), doc in manifests.items() if kind == "Service" and all(
        doc["metadata"]["labels"].get(k) == v for k, v in monitor["spec"]["selector"]["matchLabels"].items())]
    port_names = {p["name"] for s in selected for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} == {"metrics", "router-metrics"} <= port_names


def test_the_dashboard_is_grafana_json_whose_queries_parse_as_promql():
    board = dashboard()
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] == "eagle-serve"
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24
    queries = dashboard_queries()
    assert len(queries) >= 15
    names = set().union(*(metric_names(q) for q in queries))
    for wanted in ("vllm:time_to_first_token_seconds_bucket", "eagle_spec_decode_accepted_tokens_by_source_total",
                   "vllm:num_requests_waiting", "vllm_router_processed_requests_total"):
        assert wanted in names
    with pytest.raises(Exception):
        metric_names("sum(rate(vllm:prompt_tokens_total[1m])")  # a parse error is caught


def test_the_compose_monitoring_profile_provisions_prometheus_and_the_dashboard():
    compose = yaml.safe_load((paths.REPO_ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert "profiles" not in services["triton"]
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
    for service in ("prometheus", "grafana"):
        for volume in services[service]["volumes"]:
            host = volume.split(":")[0]
            assert (paths.REPO_ROOT / host).exists(), volume
    scrape = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = scrape["scrape_configs"][0]["static_configs"][0]["targets"]
    assert targets == ["triton:8002"] and "8002:8002" in services["triton"]["ports"]
    datasource = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"] == "http://prometheus:9090"
