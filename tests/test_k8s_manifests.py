"""The Kubernetes manifests in deploy/k8s, checked offline (no cluster here, no network in CI).

Every built-in object is validated strictly (unknown fields are errors) against the Kubernetes API
schemas of the oldest and newest versions we support, which the `kubernetes-validate` package ships;
custom resources (KEDA ScaledObject, Prometheus Operator PodMonitor) and the prometheus-adapter rule
file against the schemas in deploy/schemas. Then what must agree across objects: selectors, ports,
probes, the drain time, the autoscaling metric and the name the server exports it under.
"""
import copy
import json
import os
import re
from pathlib import Path

import jsonschema
import pytest
import yaml
from referencing import Registry, Resource

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
SCHEMAS = REPO / "deploy" / "schemas"
KUBERNETES_VERSIONS = ("1.28", "1.37")  # oldest we support, newest kubernetes-validate knows
CUSTOM = {("keda.sh/v1alpha1", "ScaledObject"): "keda-scaledobject-v1alpha1.json",
          ("monitoring.coreos.com/v1", "PodMonitor"): "podmonitor-v1.json"}
METRIC = "qwen3_tts_active_sessions"


def kubernetes_validate():
    try:
        import kubernetes_validate
    except ImportError:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("kubernetes-validate is not installed; CI must validate the manifests")
        pytest.skip("kubernetes-validate is not installed")
    return kubernetes_validate


def schema_validator(name: str) -> jsonschema.Draft202012Validator:
    resources = [Resource.from_contents(json.loads(p.read_text())) for p in SCHEMAS.glob("*.json")]
    registry = Registry().with_resources((r.contents["$id"], r) for r in resources)
    return jsonschema.Draft202012Validator(json.loads((SCHEMAS / name).read_text()), registry=registry)


def validate(doc: dict) -> None:
    """Raise if `doc` does not match its schema (every supported Kubernetes version for built-ins)."""
    key = (doc["apiVersion"], doc["kind"])
    if key in CUSTOM:
        schema_validator(CUSTOM[key]).validate(doc)
        return
    kv = kubernetes_validate()
    for version in KUBERNETES_VERSIONS:
        kv.validate(doc, version, strict=True)


@pytest.fixture(scope="module")
def objects() -> dict:
    """(kind, name) -> object, for every object of every manifest under deploy/k8s."""
    found = {}
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                key = (doc["kind"], doc["metadata"]["name"])
                assert key not in found, f"{key} defined twice"
                doc["_file"] = path.relative_to(K8S).as_posix()
                found[key] = doc
    return found


def strip(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "_file"}


def test_every_object_matches_its_schema(objects):
    failures = []
    for (kind, name), doc in objects.items():
        try:
            validate(strip(doc))
        except Exception as e:  # collect them all, one message per object
            failures.append(f"{doc['_file']}: {kind}/{name}: {getattr(e, 'message', e)}")
    assert not failures, "\n".join(failures)


def test_the_schemas_reject_mistakes(objects):
    """The checks above are strict: a misspelt field, a missing one or a bad value fails."""
    deployment = strip(objects["Deployment", "qwen3-tts"])
    scaled = strip(objects["ScaledObject", "qwen3-tts"])
    monitor = strip(objects["PodMonitor", "qwen3-tts"])
    ingress = strip(objects["Ingress", "qwen3-tts"])
    mistakes = []
    d = copy.deepcopy(deployment)
    d["spec"]["template"]["spec"]["terminationGracePeriod"] = 75
    mistakes.append(d)
    d = copy.deepcopy(deployment)
    d["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["path"] = 7
    mistakes.append(d)
    s = copy.deepcopy(scaled)
    del s["spec"]["triggers"][0]["metadata"]["threshold"]
    mistakes.append(s)
    s = copy.deepcopy(scaled)
    s["spec"]["maxReplicas"] = 8  # the HPA's name, not KEDA's
    mistakes.append(s)
    m = copy.deepcopy(monitor)
    m["spec"]["podMetricsEndpoints"][0]["intervall"] = "5s"
    mistakes.append(m)
    i = copy.deepcopy(ingress)
    i["spec"]["rules"][0]["http"]["paths"][0]["pathType"] = 3
    mistakes.append(i)
    for doc in mistakes:
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def test_kustomization_lists_the_default_set(objects):
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    listed = kustomization["resources"]
    assert all((K8S / f).is_file() for f in listed)
    one_off = {"model-download-job.yaml"}  # applied once, before the rest
    assert set(listed) == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"} - one_off
    images = {c["image"].split(":")[0] for doc in objects.values() if doc["kind"] in ("Deployment", "Job")
              for c in doc["spec"]["template"]["spec"]["containers"]}
    assert images == {i["name"] for i in kustomization["images"]}


def _container(doc):
    (container,) = doc["spec"]["template"]["spec"]["containers"]
    return container


def _env(container) -> dict:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def _selects(selector: dict, labels: dict) -> bool:
    return selector.items() <= labels.items()


def test_replica_pods_serve_probe_and_drain_as_the_server_does(objects):
    deployment = objects["Deployment", "qwen3-tts"]
    pod = deployment["spec"]["template"]
    container = _container(deployment)
    env = _env(container)
    (port,) = container["ports"]
    assert port["name"] == "http" and port["containerPort"] == int(env["PORT"]) and env["HOST"] == "0.0.0.0"

    ready = container["readinessProbe"]["exec"]["command"]    # with the API key: tests/test_hardening_security.py
    assert ready[:2] == ["python3", "-c"] and "/ready" in ready[2] and "API_KEY" in ready[2] and "PORT" in ready[2]
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["startupProbe"]["httpGet"]["path"] == "/health"
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # weights + CUDA graphs

    # one GPU per pod
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["resources"]["requests"].get("nvidia.com/gpu", 1) == 1

    # SIGTERM after preStop; the server then drains for DRAIN_TIMEOUT; the kill comes after both
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["spec"]["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + float(env["DRAIN_TIMEOUT"]) + 5
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    # the model and the voices come from the shared volumes
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    for var, volume in (("MODEL_DIR", "models"), ("VOICES_DIR", "voices")):
        assert env[var].startswith(mounts[volume]["mountPath"])
        claim = volumes[volume]["persistentVolumeClaim"]["claimName"]
        assert "ReadWriteMany" in objects["PersistentVolumeClaim", claim]["spec"]["accessModes"]
    assert mounts["models"]["readOnly"]

    job = objects["Job", "qwen3-tts-model-download"]
    assert f'local_dir="{env["MODEL_DIR"]}"' in _container(job)["args"][0]
    assert job["spec"]["template"]["spec"]["volumes"][0] == {
        "name": "models", "persistentVolumeClaim": {"claimName": "qwen3-tts-models"}}


def test_services_ingress_and_budget_select_the_replicas(objects):
    deployment = objects["Deployment", "qwen3-tts"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    for key in [("Service", "qwen3-tts"), ("Service", "qwen3-tts-replicas")]:
        service = objects[key]
        assert _selects(service["spec"]["selector"], labels)
        assert service["spec"]["ports"][0]["targetPort"] == "http"
        assert "sessionAffinity" not in service["spec"]  # see service.yaml: it would pin in-cluster clients
    assert objects["Service", "qwen3-tts-replicas"]["spec"]["clusterIP"] == "None"
    assert _selects(objects["PodDisruptionBudget", "qwen3-tts"]["spec"]["selector"]["matchLabels"], labels)
    assert _selects(objects["PodMonitor", "qwen3-tts"]["spec"]["selector"]["matchLabels"], labels)
    assert objects["PodMonitor", "qwen3-tts"]["spec"]["podMetricsEndpoints"][0]["path"] == "/metrics"

    ingress = objects["Ingress", "qwen3-tts"]
    notes = ingress["metadata"]["annotations"]
    prefix = "nginx.ingress.kubernetes.io/"
    assert int(notes[prefix + "proxy-read-timeout"]) >= 3600 and int(notes[prefix + "proxy-send-timeout"]) >= 3600
    assert notes[prefix + "affinity"] == "cookie" and notes[prefix + "proxy-buffering"] == "off"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    service = objects["Service", backend["name"]]
    assert backend["port"]["name"] in {p["name"] for p in service["spec"]["ports"]}
    for doc in objects.values():
        if doc["metadata"].get("namespace") not in (None, "qwen3-tts"):
            assert doc["kind"] == "ConfigMap" and doc["_file"] == "optional/prometheus-adapter.yaml"


def test_autoscaling_follows_the_metric_the_server_exports(objects):
    from app.metrics import Metrics
    exported = {family.name for family in Metrics().registry.collect()}
    assert METRIC in exported

    kv = kubernetes_validate()
    deployment = objects["Deployment", "qwen3-tts"]
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": deployment["metadata"]["name"]}

    scaled = objects["ScaledObject", "qwen3-tts"]["spec"]
    assert scaled["scaleTargetRef"] == target
    assert scaled["minReplicaCount"] >= 1  # a cold GPU replica takes minutes to become ready
    (trigger,) = scaled["triggers"]
    query = trigger["metadata"]["query"]
    assert re.search(rf"\b{METRIC}\{{namespace=\"{deployment['metadata']['namespace']}\"\}}", query)
    assert trigger["metricType"] == "AverageValue"
    # KEDA hands `behavior` to the HPA it creates: check it against the Kubernetes schema of one
    behavior = scaled["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    hpa_of_keda = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "x"},
                   "spec": {"scaleTargetRef": target, "maxReplicas": scaled["maxReplicaCount"], "behavior": behavior}}
    for version in KUBERNETES_VERSIONS:
        kv.validate(hpa_of_keda, version, strict=True)

    # the prometheus-adapter alternative: same metric, same sizing
    adapter = objects["ConfigMap", "prometheus-adapter"]
    rules = yaml.safe_load(adapter["data"]["config.yaml"])
    schema_validator("prometheus-adapter-config.json").validate(rules)
    (rule,) = rules["rules"]
    assert METRIC in rule["seriesQuery"] and re.fullmatch(rule["name"]["matches"], METRIC)
    hpa = objects["HorizontalPodAutoscaler", "qwen3-tts"]["spec"]
    (metric,) = hpa["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == rule["name"]["as"]
    assert hpa["scaleTargetRef"] == target
    assert metric["pods"]["target"]["averageValue"] == trigger["metadata"]["threshold"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (scaled["minReplicaCount"], scaled["maxReplicaCount"])
    assert hpa["behavior"] == behavior


def test_optional_router_discovers_the_replicas(objects):
    router = objects["Deployment", "qwen3-tts-router"]
    container = _container(router)
    assert container["command"] == ["python3", "-m", "app.replicas.router"]
    env = _env(container)
    headless = objects["Service", "qwen3-tts-replicas"]
    host, port = env["DISCOVER"].rsplit(":", 1)
    assert host == f"{headless['metadata']['name']}.{headless['metadata']['namespace']}.svc.cluster.local"
    assert int(port) == headless["spec"]["ports"][0]["port"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= pre_stop + float(env["DRAIN_TIMEOUT"])
    service = objects["Service", "qwen3-tts-router"]
    assert _selects(service["spec"]["selector"], router["spec"]["template"]["metadata"]["labels"])
    assert not _selects(service["spec"]["selector"], objects["Deployment", "qwen3-tts"]["spec"]["template"]["metadata"]["labels"])
