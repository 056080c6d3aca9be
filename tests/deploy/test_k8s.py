"""deploy/k8s, checked offline: every manifest validates against Kubernetes' own schemas
(kubernetes-validate --strict; the CRDs' pod templates as v1 PodTemplates), and the manifests agree
with the server they run: every argument is a flag `python -m server` parses, the probes ask
/health on the port it listens on, the grace period outlasts its drain, tensor-parallel pods get a
memory-backed /dev/shm, selectors find the pods, autoscaling reads a metric the server exports.
"""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from server.__main__ import build_parser

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES = "1.33"
# The image's ENTRYPOINT (Dockerfile): manifests' args follow it.
ENTRYPOINT = re.search(r'^ENTRYPOINT \["pagedserve", (.*)\]$', (ROOT / "Dockerfile").read_text(), re.M)
ENTRY_ARGS = [a.strip().strip('"') for a in ENTRYPOINT[1].split(",")] if ENTRYPOINT else []
# What LWS puts in the environment of a group's pods; Kubernetes expands $(VAR) in args.
LWS_ENV = {"LWS_LEADER_ADDRESS": "pagedserve-multinode-0.pagedserve-multinode", "LWS_WORKER_INDEX": "1",
           "POD_NAMESPACE": "default"}


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        out += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return out


def of_kind(kind: str) -> list[dict]:
    return [doc for _, doc in documents() if doc["kind"] == kind]


def pod_templates() -> list[tuple[str, dict]]:
    """(name, pod template) of every workload: Deployments' and the LeaderWorkerSet's two."""
    out = [(d["metadata"]["name"], d["spec"]["template"]) for d in of_kind("Deployment")]
    for lws in of_kind("LeaderWorkerSet"):
        spec = lws["spec"]["leaderWorkerTemplate"]
        out += [(f"{lws['metadata']['name']}/leader", spec["leaderTemplate"]),
                (f"{lws['metadata']['name']}/worker", spec["workerTemplate"])]
    return out


def server_containers() -> list[tuple[str, dict, dict]]:
    """(workload, pod spec, container) of every container running the pagedserve image."""
    return [(name, t["spec"], c) for name, t in pod_templates() for c in t["spec"]["containers"]
            if c["image"].split(":")[0] == "pagedserve"]


def expand(arg: str) -> str:
    return re.sub(r"\$\((\w+)\)", lambda m: LWS_ENV[m[1]], arg)


def server_args(container: dict):
    parser = build_parser()
    parser.allow_abbrev = False  # a manifest spells each flag out
    return parser.parse_args([*ENTRY_ARGS[ENTRY_ARGS.index("--host"):], *map(expand, container["args"])])


def test_every_manifest_validates_strictly():
    docs = documents()
    assert {doc["kind"] for _, doc in docs} >= {"Deployment", "Service", "PodDisruptionBudget", "ServiceAccount",
                                                "Role", "RoleBinding", "ScaledObject", "HorizontalPodAutoscaler",
                                                "LeaderWorkerSet", "Kustomization"}
    for name, doc in docs:
        if doc["kind"] in ("ScaledObject", "LeaderWorkerSet", "Kustomization"):
            continue  # custom resources (and kustomize's file): their pod templates are checked below
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)
    for name, template in pod_templates():
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                                      "template": template}, KUBERNETES, strict=True)


def test_a_broken_manifest_is_caught():
    deployment = of_kind("Deployment")[0]
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["pathh"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES, strict=True)


def test_server_args_are_flags_the_server_parses():
    assert ENTRY_ARGS[:1] == ["--host"], "the Dockerfile's ENTRYPOINT is `pagedserve --host 0.0.0.0 --port 8000`"
    containers = server_containers()
    assert len(containers) == 4
    for name, _, container in containers:
        args = server_args(container)  # argparse exits on an unknown flag or a bad value
        assert args.port == 8000, name


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
        drain = server_args(container).shutdown_timeout
        assert pod["terminationGracePeriodSeconds"] >= drain + 10, name


def test_tensor_parallel_pods_get_a_memory_backed_dev_shm_and_whole_resources():
    for name, pod, container in server_containers():
        assert container["resources"]["requests"] and container["resources"]["limits"], name
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        shm = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
        if server_args(container).tensor_parallel_size > 1:
            assert shm, f"{name}: tensor parallel needs /dev/shm room"
            assert volumes[shm[0]["name"]]["emptyDir"]["medium"] == "Memory", name
            assert volumes[shm[0]["name"]]["emptyDir"]["sizeLimit"], name
        else:
            assert not shm, name


def test_services_budgets_and_the_router_find_the_server_pods():
    deployments = {d["metadata"]["name"]: d for d in of_kind("Deployment")}
    server_labels = deployments["pagedserve"]["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in of_kind("Service")}
    for service in services.values():
        selector = service["spec"]["selector"]
        assert any(selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()
                   for d in deployments.values()), service["metadata"]["name"]
    assert services["pagedserve"]["spec"]["selector"].items() <= server_labels.items()
    pdb = of_kind("PodDisruptionBudget")[0]
    assert pdb["spec"]["selector"]["matchLabels"].items() <= server_labels.items()
    router = deployments["pagedserve-router"]["spec"]["template"]["spec"]
    args = router["containers"][0]["args"]
    after = args[args.index("--selector") + 1:]
    values = after[: next((i for i, a in enumerate(after) if a.startswith("--")), len(after))]
    selector = dict(a.split("=", 1) for a in values)
    assert selector and selector.items() <= server_labels.items(), "the router discovers the server pods"
    assert args[args.index("--service-discovery-port") + 1] == "8000"
    role = of_kind("Role")[0]
    assert {"get", "list", "watch"} <= set(role["rules"][0]["verbs"]) and role["rules"][0]["resources"] == ["pods"]
    binding = of_kind("RoleBinding")[0]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"][0]["name"] == router["serviceAccountName"]


def test_autoscaling_reads_queue_depth_the_server_exports_never_cpu():
    exported = set(re.findall(r'"(vllm:[a-z_]+)"', (ROOT / "server" / "metrics.py").read_text()))
    assert "vllm:num_requests_waiting" in exported
    scaled = of_kind("ScaledObject")[0]
    assert scaled["spec"]["scaleTargetRef"]["name"] == "pagedserve"
    for trigger in scaled["spec"]["triggers"]:
        assert trigger["type"] not in ("cpu", "memory")
        metric = re.search(r"(vllm:[a-z_]+)", trigger["metadata"]["query"])[1]
        assert metric in exported
    hpa = of_kind("HorizontalPodAutoscaler")[0]
    assert hpa["spec"]["scaleTargetRef"]["name"] == "pagedserve"
    assert all(m["type"] != "Resource" for m in hpa["spec"]["metrics"]), "never CPU or memory"


def test_kustomization_lists_files_that_exist():
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
