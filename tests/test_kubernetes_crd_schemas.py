"""rayservice.yaml and podmonitors.yaml against the CRDs their operators publish (KubeRay's
RayService, Prometheus Operator's PodMonitor): the `openAPIV3Schema` of the served version, with
`jsonschema`, plus what the API server would do silently: drop fields its schema does not know
(structural pruning), so a misspelt field is reported here instead of vanishing on a cluster.

The CRD files and their provenance (release, commit, URL, sha256) are listed in
kubernetes/schemas/SOURCES.json; the files are resolved by engine/datasets.py like every data set
(MORPHSERVE_DATA_<NAME>, ../shared/crds/, the user cache, a download pinned to the same sha256), and
the test skips, naming the file and how to get it, only when none of those has it."""
from __future__ import annotations

import copy
import functools
import hashlib
import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "kubernetes"
SOURCES = json.loads((K8S / "schemas" / "SOURCES.json").read_text())["crds"]


DATA_SETS = {"RayService": "kuberay_rayservice_crd", "PodMonitor": "podmonitor_crd"}


@functools.lru_cache(maxsize=None)
def crd_schema(kind: str) -> dict:
    from engine.datasets import dataset, resolve
    from engine.errors import DataUnavailableError

    source = SOURCES[kind]
    data = dataset(DATA_SETS[kind])
    assert (data.sha256, data.file_name) == (source["sha256"], source["file"]), "SOURCES.json and the data module disagree"
    try:
        path = resolve(data)
    except DataUnavailableError as e:
        pytest.skip(f"{source['project']} {source['release']} CRD: {e}")
    raw = path.read_bytes()
    assert hashlib.sha256(raw).hexdigest() == source["sha256"], f"{path} is not the recorded {source['release']} file"
    crd = yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1 MB: the C loader
    assert crd["spec"]["names"]["kind"] == kind
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == source["version"]]
    assert version["served"]
    return version["schema"]["openAPIV3Schema"]


def manifests(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d]


def schema_errors(doc: dict, schema: dict) -> list[str]:
    from jsonschema import Draft4Validator  # OpenAPI 3.0 schemas are a JSON Schema draft-4 dialect

    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in Draft4Validator(schema).iter_errors(doc)]


def unknown_fields(doc: Any, schema: dict, path: str = "") -> Iterator[str]:
    """Fields the API server would prune: not in `properties` where the schema lists them."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(doc, dict):
        props, extra = schema.get("properties"), schema.get("additionalProperties")
        for key, value in doc.items():
            if props is not None and key in props:
                yield from unknown_fields(value, props[key], f"{path}/{key}")
            elif isinstance(extra, dict):
                yield from unknown_fields(value, extra, f"{path}/{key}")
            elif props is not None and extra is None:
                yield f"{path}/{key}"
    elif isinstance(doc, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(doc):
            yield from unknown_fields(item, schema["items"], f"{path}/{i}")


def test_the_rayservice_matches_kuberays_published_crd():
    schema = crd_schema("RayService")
    (rayservice,) = manifests("rayservice.yaml")
    assert schema_errors(rayservice, schema) == []
    assert list(unknown_fields(rayservice, schema)) == []


def test_the_pod_monitors_match_prometheus_operators_published_crd():
    schema = crd_schema("PodMonitor")
    for monitor in manifests("podmonitors.yaml"):
        assert schema_errors(monitor, schema) == [], monitor["metadata"]["name"]
        assert list(unknown_fields(monitor, schema)) == [], monitor["metadata"]["name"]


def test_the_checks_catch_a_wrong_type_and_a_misspelt_field():
    schema = copy.deepcopy(crd_schema("RayService"))
    (rayservice,) = manifests("rayservice.yaml")
    broken = copy.deepcopy(rayservice)
    broken["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "one"
    broken["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParam"] = {}
    assert any("replicas" in e for e in schema_errors(broken, schema))
    assert list(unknown_fields(broken, schema)) == ["/spec/rayClusterConfig/headGroupSpec/rayStartParam"]
    monitor = copy.deepcopy(manifests("podmonitors.yaml")[0])
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "5s"
    assert list(unknown_fields(monitor, crd_schema("PodMonitor"))) == ["/spec/podMetricsEndpoints/0/intervall"]
