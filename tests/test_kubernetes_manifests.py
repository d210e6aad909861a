"""KubeRay manifests, checked offline with the libraries that will read them: Ray Serve's config
schema for serveConfigV2, the kubernetes client's models for pod templates, cross-references
between the RayService, the PodMonitors, the dashboard ConfigMap and the kustomization."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import ray
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "kubernetes"
DASHBOARD = REPO / "ops" / "monitoring" / "grafana" / "dashboards" / "morphserve.json"
# Labels KubeRay puts on every Ray pod (ray-operator's labelPod); the values we can know up front.
KUBERAY_LABELS = {"ray.io/node-type", "ray.io/cluster", "ray.io/group", "ray.io/is-ray-node"}


def load(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


@pytest.fixture(scope="module")
def rayservice() -> dict:
    (doc,) = load("rayservice.yaml")
    return doc


def groups(rayservice: dict) -> dict[str, dict]:
    """node type -> group spec (one head group; this project has one worker group)."""
    cluster = rayservice["spec"]["rayClusterConfig"]
    (worker,) = cluster["workerGroupSpecs"]
    return {"head": cluster["headGroupSpec"], "worker": worker}


def containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def test_rayservice_kind_and_version(rayservice):
    assert rayservice["apiVersion"] == "ray.io/v1" and rayservice["kind"] == "RayService"
    assert rayservice["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__


def test_serve_config_parses_with_ray_serve_schema(rayservice):
    from ray.serve.schema import DeploymentSchema, ServeApplicationSchema, ServeDeploySchema

    raw = yaml.safe_load(rayservice["spec"]["serveConfigV2"])
    config = ServeDeploySchema.model_validate(raw)
    # ServeDeploySchema tolerates unknown keys (forward compatibility); a typo must not pass.
    assert set(raw) <= set(ServeDeploySchema.model_fields)
    (app,) = config.applications
    (raw_app,) = raw["applications"]
    assert set(raw_app) <= set(ServeApplicationSchema.model_fields)
    for dep in raw_app["deployments"]:
        assert set(dep) <= set(DeploymentSchema.model_fields), dep
    assert app.import_path == "deployments:build_app"
    assert {d.name for d in app.deployments} == {"LLMServer", "OpenAIIngress"}
    assert app.args["mode"] in ("accuracy", "balanced", "performance")
    assert {"model", "memory_budget"} <= set(app.args)
    llm = next(d for d in app.deployments if d.name == "LLMServer")
    assert llm.ray_actor_options.num_gpus >= 1


def test_pod_templates_deserialize_into_kubernetes_models_without_unknown_fields(rayservice):
    from kubernetes.client import ApiClient

    client = ApiClient()
    for node_type, group in groups(rayservice).items():
        template = group["template"]
        model = client._ApiClient__deserialize(template, "V1PodTemplateSpec")
        # Unknown or misspelt fields are dropped by the models, so a round trip shows them.
        assert client.sanitize_for_serialization(model) == template, node_type


def test_ray_start_params_keep_gpu_work_off_the_head(rayservice):
    for group in groups(rayservice).values():
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())
    head = groups(rayservice)["head"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    for c in containers(head):
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_head_ports_and_worker_gpus(rayservice):
    g = groups(rayservice)
    head_ports = {p["name"]: p["containerPort"] for c in containers(g["head"]) for p in c["ports"]}
    assert head_ports == {"gcs": 6379, "dashboard": 8265, "serve": 8000, "metrics": 8080,
                          "as-metrics": 44217, "dash-metrics": 44227}
    for c in containers(g["worker"]):
        res = c["resources"]
        assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    for group in g.values():
        for c in containers(group):
            for kind in ("requests", "limits"):
                assert {"cpu", "memory"} <= set(c["resources"][kind]), (c["name"], kind)


def test_every_container_runs_one_image_built_from_the_ray_base(rayservice):
    images = {c["image"] for group in groups(rayservice).values() for c in containers(group)}
    assert len(images) == 1
    dockerfile = (K8S / "Dockerfile").read_text()
    base = re.search(r"^FROM\s+(\S+)", dockerfile, re.M).group(1)
    assert base == f"rayproject/ray:{ray.__version__}-py311-gpu"
    (image,) = images
    assert image == base or "morphserve" in image


def test_pod_monitors_select_labels_and_ports_that_exist(rayservice):
    monitors = load("podmonitors.yaml")
    by_type = groups(rayservice)
    seen = set()
    for pm in monitors:
        assert pm["apiVersion"] == "monitoring.coreos.com/v1" and pm["kind"] == "PodMonitor"
        selector = pm["spec"]["selector"]
        node_type = selector["matchLabels"]["ray.io/node-type"]
        seen.add(node_type)
        group = by_type[node_type]
        template_labels = group["template"]["metadata"]["labels"]
        for key, value in selector["matchLabels"].items():
            if key != "ray.io/node-type":
                assert template_labels.get(key) == value, key
        for expr in selector.get("matchExpressions", []):
            assert expr["key"] in KUBERAY_LABELS | set(template_labels)
        ports = {p["name"] for c in containers(group) for p in c.get("ports", [])}
        for endpoint in pm["spec"]["podMetricsEndpoints"]:
            assert endpoint["port"] in ports
    assert seen == {"head", "worker"}
    cluster_keys = {e["key"] for pm in monitors for e in pm["spec"]["selector"]["matchExpressions"]}
    assert "ray.io/cluster" in cluster_keys


def test_configmap_embeds_the_dashboard_json_verbatim():
    (cm,) = load("grafana-dashboard-configmap.yaml")
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["data"]["morphserve.json"] == DASHBOARD.read_text()


def test_kustomization_lists_every_manifest():
    (kustomization,) = load("kustomization.yaml")
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml", "secret.example.yaml"}
    assert set(kustomization["resources"]) == manifests


def test_secrets_reach_every_ray_container_from_the_secret_and_nothing_is_in_the_args(rayservice):
    from deployments.app_args import ADMIN_TOKEN_ENV, API_KEY_ENV

    (secret,) = load("secret.example.yaml")
    assert secret["kind"] == "Secret" and "secret.example.yaml" not in load("kustomization.yaml")[0]["resources"]
    for node_type, group in groups(rayservice).items():
        for c in containers(group):
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in c.get("env", []) if "valueFrom" in e}
            assert set(refs) >= {API_KEY_ENV, ADMIN_TOKEN_ENV}, (node_type, c["name"])
            for ref in refs.values():
                assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["stringData"]
                assert not ref.get("optional"), "a missing secret must stop the pod, not disable auth"
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "api_key" not in args and "admin_token" not in args


def test_workers_keep_the_model_cache_on_a_claim_and_fetch_a_non_default_model_first(rayservice):
    from kubernetes.client import ApiClient

    (claim,) = load("model-cache-pvc.yaml")
    model = ApiClient()._ApiClient__deserialize(claim, "V1PersistentVolumeClaim")
    assert ApiClient().sanitize_for_serialization(model) == claim
    spec = groups(rayservice)["worker"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v["name"] == "morphserve-cache"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (init,) = spec["initContainers"]
    assert init["command"][:3] == ["python", "-m", "ops.fetch_model"] and init["image"] == containers(
        groups(rayservice)["worker"])[0]["image"]
    mounts = {m["name"]: m["mountPath"] for c in [init, *spec["containers"]] for m in c["volumeMounts"]}
    assert mounts == {"morphserve-cache": "/home/ray/.cache/morphserve"}


def test_fetch_model_downloads_once_and_is_a_no_op_without_a_model(tmp_path):
    from ops.fetch_model import fetch

    calls = []

    def download(repo_id, revision, local_dir, allow_patterns):
        calls.append(repo_id)
        (Path(local_dir) / "config.json").parent.mkdir(parents=True, exist_ok=True)
        (Path(local_dir) / "config.json").write_text("{}")
        return local_dir

    assert fetch("", tmp_path, download=download) is None and calls == []
    folder = fetch("org/model-1", tmp_path, download=download)
    assert folder == tmp_path / "models" / "org--model-1" and (folder / "config.json").is_file()
    assert fetch("org/model-1", tmp_path, download=download) == folder and calls == ["org/model-1"]
    with pytest.raises(ValueError, match="repo id"):
        fetch("../etc", tmp_path, download=download)


def test_head_pod_monitor_scrapes_the_autoscaler_and_dashboard_metrics_with_a_job_label(rayservice):
    monitors = {pm["spec"]["selector"]["matchLabels"]["ray.io/node-type"]: pm for pm in load("podmonitors.yaml")}
    head_ports = {p["name"] for c in containers(groups(rayservice)["head"]) for p in c["ports"]}
    assert {e["port"] for e in monitors["head"]["spec"]["podMetricsEndpoints"]} == {"metrics", "as-metrics", "dash-metrics"}
    assert {"as-metrics", "dash-metrics"} <= head_ports
    for node_type, pm in monitors.items():
        label = pm["spec"]["jobLabel"]
        assert label in groups(rayservice)[node_type]["template"]["metadata"]["labels"], node_type
