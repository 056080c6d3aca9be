"""deploy/k8s, checked offline: every manifest validates against Kubernetes' own schemas
(kubernetes-validate --strict; the CRDs' pod templates as v1 PodTemplates), and the manifests agree
with what they run: every server argument is a flag `python -m server` parses and every router
argument one vllm-router parses, the probes ask /health on the port the server listens on, the
grace period outlasts its drain, tensor-parallel pods get a memory-backed /dev/shm, selectors find
the pods they mean and no others, autoscaling reads a series the server really exports.
"""

from __future__ import annotations

import copy
import functools
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.stats import EngineStats
from models.fetch import DEFAULT_MODEL
from server.__main__ import build_parser
from server.metrics import ServerMetrics

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33"
CUSTOM_KINDS = ("ScaledObject", "LeaderWorkerSet", "Kustomization")  # no schema in kubernetes-validate
DOCKERFILE = (ROOT / "Dockerfile").read_text()
# The image's ENTRYPOINT (`pagedserve --host 0.0.0.0 --port 8000`): manifests' args follow it.
ENTRYPOINT = re.search(r'^ENTRYPOINT \["pagedserve", (.*)\]$', DOCKERFILE, re.M)
ENTRY_ARGS = [a.strip().strip('"') for a in ENTRYPOINT[1].split(",")] if ENTRYPOINT else []
IMAGE_UID = re.search(r"useradd .*--uid (\d+)", DOCKERFILE)
# What the pod's environment holds when Kubernetes expands $(VAR) in args (LWS sets the first two).
POD_ENV = {
    "LWS_LEADER_ADDRESS": "pagedserve-multinode-0.pagedserve-multinode",
    "LWS_WORKER_INDEX": "1",
    "POD_NAMESPACE": "default",
}


@functools.cache
def documents() -> tuple[tuple[str, dict], ...]:
    """(file name, document) of every manifest, parsed once: a test that changes one copies it first."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return tuple(out)


def of_kind(kind: str) -> dict[str, dict]:
    return {doc["metadata"]["name"]: doc for _, doc in documents() if doc["kind"] == kind}


def pod_templates() -> dict[str, dict]:
    """Every workload's pod template by name: Deployments' and the LeaderWorkerSet's two."""
    out = {name: d["spec"]["template"] for name, d in of_kind("Deployment").items()}
    for name, lws in of_kind("LeaderWorkerSet").items():
        spec = lws["spec"]["leaderWorkerTemplate"]
        out[f"{name}/leader"], out[f"{name}/worker"] = spec["leaderTemplate"], spec["workerTemplate"]
    return out


def selected(selector: dict) -> set[str]:
    """The workloads whose pods carry every label of `selector`."""
    return {
        name
        for name, t in pod_templates().items()
        if selector.items() <= t.get("metadata", {}).get("labels", {}).items()
    }


def server_containers() -> list[tuple[str, dict, dict]]:
    """(workload, pod spec, container) of every container running the pagedserve image."""
    return [
        (name, t["spec"], c)
        for name, t in pod_templates().items()
        for c in t["spec"]["containers"]
        if c["image"].split(":")[0] == "pagedserve"
    ]


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: POD_ENV[m[1]], arg)


def server_args(container: dict):
    parser = build_parser()
    parser.allow_abbrev = False  # a manifest spells each flag out
    return parser.parse_args([*ENTRY_ARGS, *map(expand, container["args"])])


def router_args(container: dict):
    from vllm_router.launch_router import parse_router_args

    return parse_router_args([*map(expand, container["args"])])


def exported_series() -> dict[str, set[str]]:
    """Metric name -> label names, as a live server's /metrics renders them (engine gauges included)."""
    metrics = ServerMetrics()
    metrics.watch_engine(lambda: EngineStats(num_kv_blocks_total=8), model_name="m")
    text = metrics.render().decode()
    return {s.name: set(s.labels) for family in text_string_to_metric_families(text) for s in family.samples}


def test_every_manifest_validates_strictly():
    docs = documents()
    assert {doc["kind"] for _, doc in docs} >= {
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ScaledObject",
        "HorizontalPodAutoscaler",
        "LeaderWorkerSet",
        "Kustomization",
    }
    for _, doc in docs:
        if doc["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    for template in pod_templates().values():  # the custom resources' too
        kubernetes_validate.validate(
            {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
            KUBERNETES,
            strict=True,
        )


def test_a_broken_manifest_is_caught():
    deployment = copy.deepcopy(of_kind("Deployment")["pagedserve"])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def test_server_args_are_flags_the_server_parses_on_the_images_port():
    assert ENTRY_ARGS[:2] == ["--host", "0.0.0.0"] and "--port" in ENTRY_ARGS, "the Dockerfile's ENTRYPOINT"
    containers = server_containers()
    assert len(containers) == 4
    for name, pod, container in containers:
        args = server_args(container)  # argparse exits on an unknown flag or a bad value
        assert "--port" not in container["args"], f"{name}: the image fixes the port (Dockerfile)"
        assert f"EXPOSE {args.port}" in DOCKERFILE, name
        mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
        volumes = {v["name"] for v in pod.get("volumes", [])}
        if args.model != DEFAULT_MODEL:  # else the model baked into the image
            under = [path for path in mounts if args.model.startswith(path.rstrip("/") + "/")]
            assert under and mounts[under[0]] in volumes, f"{name}: --model {args.model} is on no volume"


def test_probes_ask_health_on_the_port_the_server_listens_on():
    for name, _, container in server_containers():
        ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
        probes = [container[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in container]
        if name.endswith("/worker"):  # a worker node's ranks serve no HTTP
            assert not probes and server_args(container).node_rank > 0
            continue
        assert len(probes) == 3, f"{name}: startup, readiness and liveness probes"
        for probe in probes:
            assert probe["httpGet"]["path"] == "/health", name
            assert ports[probe["httpGet"]["port"]] == server_args(container).port, name
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 300, f"{name}: time to load the model"


def test_grace_period_outlasts_the_drain():
    for name, pod, container in server_containers():
        drain = server_args(container).shutdown_timeout  # the flag, or the parser's default
        assert pod["terminationGracePeriodSeconds"] >= drain + 10, name


def test_threads_fill_the_cpus_the_pod_gets():
    # Requests = limits in whole CPUs: Guaranteed QoS, whose cores the static CPU manager pins. Without
    # that manager the pod's CPU affinity is the whole node, so the automatic thread count would
    # oversubscribe its limit: each pod sets --num-threads (per rank) to fill its CPUs exactly.
    for name, _, container in server_containers():
        resources, args = container["resources"], server_args(container)
        assert resources["requests"] == resources["limits"] and {"cpu", "memory"} <= resources["limits"].keys(), name
        ranks_here = args.tensor_parallel_size // args.nnodes
        assert args.num_threads is not None and args.num_threads * ranks_here == int(resources["limits"]["cpu"]), name


def test_tensor_parallel_pods_get_a_memory_backed_dev_shm():
    for name, pod, container in server_containers():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        if server_args(container).tensor_parallel_size > 1:
            assert shm, f"{name}: tensor parallel needs /dev/shm room"
            assert volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory", name
            assert volumes[shm[0]["name"]]["emptyDir"]["sizeLimit"], name
        else:
            assert not shm, name


def test_server_pods_run_as_the_images_user():
    assert IMAGE_UID, "the Dockerfile creates its user with useradd --uid"
    for name, pod, _ in server_containers():
        assert pod["securityContext"]["runAsUser"] == int(IMAGE_UID[1]), name


def test_services_and_the_budget_select_one_workloads_pods():
    templates = pod_templates()
    for name, service in of_kind("Service").items():
        workloads = selected(service["spec"]["selector"])
        assert len(workloads) == 1, f"Service {name} selects {workloads or 'nothing'}"
        ports = {p["name"] for c in templates[workloads.pop()]["spec"]["containers"] for p in c.get("ports", [])}
        assert all(p["targetPort"] in ports for p in service["spec"]["ports"]), name
    assert selected(of_kind("Service")["pagedserve"]["spec"]["selector"]) == {"pagedserve"}
    assert selected(of_kind("PodDisruptionBudget")["pagedserve"]["spec"]["selector"]["matchLabels"]) == {"pagedserve"}


def test_router_discovers_the_server_pods_with_the_rights_it_needs():
    router = of_kind("Deployment")["pagedserve-router"]["spec"]["template"]["spec"]
    container = router["containers"][0]
    args = router_args(container)  # vllm-router's own parser: exits on an unknown flag
    assert args.service_discovery and selected(args.selector) == {"pagedserve"}, "the server pods, not the router's"
    server = server_args(of_kind("Deployment")["pagedserve"]["spec"]["template"]["spec"]["containers"][0])
    assert args.service_discovery_port == server.port
    namespace = {e["name"]: e for e in container["env"]}["POD_NAMESPACE"]
    assert namespace["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace", "a Role covers one namespace"
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports["http"] == args.port and ports["metrics"] == args.prometheus_port
    assert args.prometheus_host == "0.0.0.0", "its default, 127.0.0.1, is out of Prometheus' reach"
    role = of_kind("Role")["pagedserve-router"]
    assert any(
        {"get", "list", "watch"} <= set(rule["verbs"]) and "pods" in rule["resources"] and rule["apiGroups"] == [""]
        for rule in role["rules"]
    )
    binding = of_kind("RoleBinding")["pagedserve-router"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "pagedserve-router"}
    assert {"kind": "ServiceAccount", "name": router["serviceAccountName"]} in binding["subjects"]


def test_autoscaling_reads_a_queue_the_server_exports_never_cpu():
    series = exported_series()
    server = server_args(of_kind("Deployment")["pagedserve"]["spec"]["template"]["spec"]["containers"][0])
    target = {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve"}
    annotations = of_kind("Deployment")["pagedserve"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(server.port),
        "prometheus.io/path": "/metrics",
    }, "Prometheus scrapes what autoscaling reads"
    scaled = of_kind("ScaledObject")["pagedserve"]
    assert scaled["spec"]["scaleTargetRef"] == target
    assert scaled["spec"]["triggers"] and all(t["type"] == "prometheus" for t in scaled["spec"]["triggers"])
    for trigger in scaled["spec"]["triggers"]:
        metric, matchers = re.search(r"(vllm:\w+)\{([^}]*)\}", trigger["metadata"]["query"]).groups()
        assert metric == "vllm:num_requests_waiting" and metric in series
        labels = dict(re.findall(r'(\w+)="([^"]*)"', matchers))
        assert labels.keys() <= series[metric], f"{metric} has no label {labels.keys() - series[metric]}"
        assert labels.get("model_name") == server.served_model_name, "the queue of the model the target serves"
    hpa = of_kind("HorizontalPodAutoscaler")["pagedserve"]
    assert hpa["spec"]["scaleTargetRef"] == target
    assert all(m["type"] == "External" for m in hpa["spec"]["metrics"]), "never CPU or memory"
    for m in hpa["spec"]["metrics"]:  # prometheus-adapter's name for vllm:<x> is vllm_<x>
        assert m["external"]["metric"]["name"].replace("vllm_", "vllm:", 1) in series
        assert m["external"]["metric"]["selector"]["matchLabels"] == {"model_name": server.served_model_name}


def test_kustomization_lists_files_that_exist_and_one_autoscaler():
    resources = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert all((K8S / resource).is_file() for resource in resources), resources
    assert sum(r.startswith("autoscaling-") for r in resources) == 1, "KEDA and the HPA would fight"
