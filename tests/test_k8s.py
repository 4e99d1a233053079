"""The Kubernetes manifests (docker/k8s) check out offline, without a cluster.

`kubectl kustomize` renders each overlay; every object validates against the Kubernetes
schemas (kubernetes-validate, strict: unknown fields fail) and the PodMonitor against the
Prometheus operator's CRD (tests/data/k8s). Then the pieces are checked against each other
and against the server itself: probe paths are routes of the real app, ports agree, the
drain fits the grace period, the HPA's metric names are what the prometheus-adapter rule
makes of series the server exports, and the flags parse with the real command line.
"""

from __future__ import annotations

import copy
import functools
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from fastapi.testclient import TestClient

from ringserve.server import metrics
from ringserve.server.app import create_app
from ringserve.server.cli import ABORT_GRACE_S, build_parser
from ringserve.server.state import ServeArgs
from tests.deploy_utils import DOCKER, ROOT, tool

K8S = DOCKER / "k8s"
DATA = ROOT / "tests" / "data" / "k8s"
OVERLAYS = ("cpu", "gpu")
IDS = [f"overlay-{o}" for o in OVERLAYS]
# The oldest Kubernetes the manifests need (the preStop `sleep` action is on by default from
# 1.30) and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.30", "1.37")
# CustomResourceDefinitions kubernetes-validate has no schema for: (group, kind) -> CRD file.
CRDS = {("monitoring.coreos.com", "PodMonitor"): DATA / "monitoring.coreos.com_podmonitors.yaml"}
NAMESPACE = "ringserve"
ADAPTER = ("monitoring", "ringserve-adapter-rules")  # the adapter's namespace, the chart's name
SESSION_HEADER = "X-Session-Id"

Obj = dict[str, Any]


# -- rendering ----------------------------------------------------------------------------

def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.fail("kubectl is not installed: CI's machine image has it; elsewhere install "
                    "kubectl (1.32 is the one tested; it embeds kustomize): "
                    "https://kubernetes.io/docs/tasks/tools/")
    return found


def kustomize(path: Path) -> list[Obj]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, f"kubectl kustomize {path}:\n{out.stderr}"
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@functools.cache
def _rendered(overlay: str) -> tuple[Obj, ...]:
    return tuple(kustomize(K8S / "overlays" / overlay))


def rendered(overlay: str) -> list[Obj]:
    """The overlay's objects (a copy: tests may not change each other's)."""
    return copy.deepcopy(list(_rendered(overlay)))


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind
            and (name is None or o["metadata"]["name"] == name)]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def server_container(objs: list[Obj]) -> Obj:
    pod = one(objs, "Deployment", "ringserve")["spec"]["template"]["spec"]
    containers: list[Obj] = pod["containers"]
    return next(c for c in containers if c["name"] == "ringserve")


def flags(args: list[str]) -> dict[str, str]:
    """`--name value` pairs of a command line (every ringserve flag here takes a value)."""
    assert args[0] == "serve", args
    rest = args[1:]
    assert len(rest) % 2 == 0 and all(a.startswith("--") for a in rest[::2]), args
    return {k.removeprefix("--"): v for k, v in zip(rest[::2], rest[1::2], strict=True)}


def container_port(container: Obj, port: int | str) -> int:
    """A probe's or Service's port (a name or a number) as the container's port number."""
    ports: list[Obj] = container["ports"]
    for p in ports:
        if port in (p.get("name"), p["containerPort"]):
            return int(p["containerPort"])
    raise AssertionError(f"port {port!r} is not a port of container {container['name']}")


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and selector.items() <= labels.items()


# -- validation ---------------------------------------------------------------------------

def _strict(schema: Any) -> Any:
    """An openAPIV3Schema as the API server's strict field validation reads it: an object
    with declared properties takes no others (unless it preserves unknown fields)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@functools.cache
def crd_validator(group: str, kind: str, version: str) -> jsonschema.Draft4Validator:
    docs = [d for d in yaml.safe_load_all(CRDS[(group, kind)].read_text()) if d]
    crd = one(docs, "CustomResourceDefinition")
    assert (crd["spec"]["group"], crd["spec"]["names"]["kind"]) == (group, kind)
    served = {v["name"]: v for v in crd["spec"]["versions"] if v["served"]}
    assert version in served, f"{group}/{version} {kind} is not served by the stored CRD"
    schema = _strict(served[version]["schema"]["openAPIV3Schema"])
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def validate(obj: Obj, kube_version: str) -> None:
    """Fails the test with the first schema error of ``obj``."""
    where = f"{obj['kind']}/{obj['metadata']['name']}"
    group, _, version = obj["apiVersion"].rpartition("/")
    if (group, obj["kind"]) in CRDS:
        # kubernetes-validate knows no CRD: it raises SchemaNotFoundError (its command line
        # only warns and passes). The CRD's schema checks the spec; ObjectMeta is checked
        # by kubernetes-validate inside a stand-in object that has nothing else.
        errors = sorted(crd_validator(group, obj["kind"], version).iter_errors(obj),
                        key=lambda e: list(e.path))
        assert not errors, f"{where}: {'.'.join(map(str, errors[0].path))}: {errors[0].message}"
        validate({"apiVersion": "v1", "kind": "ConfigMap", "metadata": obj["metadata"]},
                 kube_version)
        return
    try:
        kubernetes_validate.validate(obj, kube_version, strict=True)
    except kubernetes_validate.ValidationError as err:
        path = ".".join(map(str, err.path))
        pytest.fail(f"{where} against Kubernetes {err.version}: {path}: {err.message}")
    except kubernetes_validate.SchemaNotFoundError as err:
        pytest.fail(f"{where}: {err.message}; store its CRD under tests/data/k8s (CRDS)")


# -- the server's side --------------------------------------------------------------------

@functools.cache
def app_client() -> TestClient:
    """The real app, routed for real; its lifespan never starts, so no model loads and it
    answers as a server that is still starting."""
    return TestClient(create_app(ServeArgs(model="x")))


def before_ready(path: str) -> tuple[int, Any]:
    """Status and body of ``GET path`` while the model is not loaded yet (404: no route)."""
    r = app_client().get(path)
    return r.status_code, r.json()


def dockerfile(overlay: str) -> str:
    return (DOCKER / ("Dockerfile" if overlay == "cpu" else "Dockerfile.cuda")).read_text()


def compose_flags(overlay: str) -> dict[str, str]:
    """The compose service's `serve` flags, each `${VAR:-default}` at its default."""
    name, key = (("docker-compose.yml", "x-ringserve") if overlay == "cpu"
                 else ("docker-compose.gpu.yml", "x-gpu"))
    command = yaml.safe_load((DOCKER / name).read_text())[key]["command"]
    return flags([re.sub(r"^\$\{\w+:-(.*)\}$", r"\1", str(a)) for a in command])


def go_expand(template: str, match: re.Match[str]) -> str:
    """Go's Regexp.ExpandString, which prometheus-adapter applies to `name.as`."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1) or m.group(2)
        if name.isdigit():
            i = int(name)
            return (match.group(i) or "") if i <= match.re.groups else ""
        return match.groupdict().get(name) or ""
    return re.sub(r"\$\$|\$\{(\w+)\}|\$(\w+)", sub, template)


def adapter_rules(objs: list[Obj]) -> list[Obj]:
    cm = one(objs, "ConfigMap", ADAPTER[1])
    assert cm["metadata"]["namespace"] == ADAPTER[0]
    rules: list[Obj] = yaml.safe_load(cm["data"]["config.yaml"])["rules"]
    return rules


def adapter_metric(rule: Obj) -> tuple[str, str]:
    """(the Prometheus series a rule selects, the custom metric name it serves it as)."""
    series = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{(.*)\}", rule["seriesQuery"])
    assert series, f"seriesQuery must name one series: {rule['seriesQuery']}"
    m = re.search(rule["name"]["matches"], series.group(1))
    assert m, rule
    return series.group(1), go_expand(rule["name"]["as"], m)


def nginx_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([kKmMgG]?)", text)
    assert m, text
    return int(m.group(1)) * {"": 1, "k": 2**10, "m": 2**20, "g": 2**30}[m.group(2).lower()]


# -- the tests ----------------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_overlay_renders(overlay: str) -> None:
    objs = rendered(overlay)
    kinds = sorted(o["kind"] for o in objs)
    assert kinds == sorted(["Namespace", "ConfigMap", "Deployment", "Service", "Service",
                            "Ingress", "Ingress", "PodDisruptionBudget",
                            "HorizontalPodAutoscaler", "PodMonitor"])
    for o in objs:
        if o["kind"] == "Namespace":
            assert o["metadata"]["name"] == NAMESPACE
        elif (o["metadata"].get("namespace"), o["metadata"]["name"]) != ADAPTER:
            assert o["metadata"].get("namespace") == NAMESPACE, o["metadata"]


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_objects_validate_against_the_schemas(overlay: str, kube_version: str) -> None:
    for obj in rendered(overlay):
        validate(obj, kube_version)


def test_validation_is_strict_and_covers_the_podmonitor() -> None:
    """Unknown or mistyped fields fail, in built-in kinds and in the PodMonitor alike."""
    objs = rendered("cpu")
    deployment = one(objs, "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["startupProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[0], strict=True)
    monitor = one(objs, "PodMonitor")
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate(monitor, KUBE_VERSIONS[-1], strict=True)
    validate(monitor, KUBE_VERSIONS[-1])
    validator = crd_validator("monitoring.coreos.com", "PodMonitor", "v1")
    typo = copy.deepcopy(monitor)
    typo["spec"]["podMetricsEndpoints"][0]["paht"] = "/metrics"
    assert not validator.is_valid(typo)
    wrong_type = copy.deepcopy(monitor)
    wrong_type["spec"]["podMetricsEndpoints"] = {"port": "http"}
    assert not validator.is_valid(wrong_type)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_probes_and_ports_match_the_server(overlay: str) -> None:
    objs = rendered(overlay)
    c = server_container(objs)
    args = flags(c["args"])
    port = int(args["port"])
    assert args["host"] == "0.0.0.0"  # the kubelet and the Services reach the pod's IP
    assert container_port(c, "http") == port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        # The health route: 503 "starting" until the model is loaded (also while stopping).
        status, body = before_ready(get["path"])
        assert (status, body.get("status")) == (503, "starting"), (probe, get["path"], body)
        assert container_port(c, get["port"]) == port, probe
    pod_labels = one(objs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
    for s in services.values():
        assert matches(s["spec"]["selector"], pod_labels), s["metadata"]["name"]
        for p in s["spec"]["ports"]:
            assert container_port(c, p["targetPort"]) == port, s["metadata"]["name"]
    for ing in find(objs, "Ingress"):
        for rule in ing["spec"]["rules"]:
            for path in rule["http"]["paths"]:
                backend = path["backend"]["service"]
                ports = services[backend["name"]]["spec"]["ports"]
                assert backend["port"]["name"] in {p["name"] for p in ports}
    monitor = one(objs, "PodMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], pod_labels)
    for ep in monitor["spec"]["podMetricsEndpoints"]:
        assert ep["path"] == "/metrics"
        assert before_ready(ep["path"])[0] == 503  # routed; series come once the model loads
        assert container_port(c, ep["port"]) == port
    deployment = one(objs, "Deployment")
    assert matches(deployment["spec"]["selector"]["matchLabels"], pod_labels)
    pdb = one(objs, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"]["matchLabels"], pod_labels)


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_args_parse_with_the_real_command_line(overlay: str) -> None:
    c = server_container(rendered(overlay))
    try:
        ns = build_parser().parse_args(c["args"])
    except SystemExit:  # argparse has printed why
        pytest.fail(f"`ringserve {' '.join(c['args'])}` does not parse")
    assert ns.command == "serve"
    args = flags(c["args"])
    assert ns.shutdown_timeout == float(args["shutdown-timeout"])
    # Same server as compose runs (model, KV pool, sequences, device).
    assert compose_flags(overlay).items() <= args.items()


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_drain_fits_the_grace_period(overlay: str) -> None:
    objs = rendered(overlay)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(objs)
    shutdown = float(flags(c["args"])["shutdown-timeout"])
    pre_stop = c["lifecycle"]["preStop"]
    if "sleep" in pre_stop:
        sleep = float(pre_stop["sleep"]["seconds"])
    else:
        command = pre_stop["exec"]["command"]
        assert Path(command[0]).name == "sleep", command
        sleep = float(command[1])
    assert sleep >= 2, "endpoints need a moment to leave the Services and the Ingress"
    drain = sleep + shutdown
    # SIGTERM comes after preStop; the server then needs up to --shutdown-timeout, and up to
    # ABORT_GRACE_S more to write out the responses it aborted.
    assert pod["terminationGracePeriodSeconds"] > drain + ABORT_GRACE_S
    # A probe that fails during the drain must not get the pod killed before it ends.
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] > drain
    # The first start converts the model: at least the Dockerfile's start period, and ~10 min.
    start = c["startupProbe"]
    period = re.search(r"--start-period=(\d+)s", dockerfile(overlay))
    assert period
    assert start["periodSeconds"] * start["failureThreshold"] >= max(600, int(period.group(1)))


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_security_context_and_writable_paths(overlay: str) -> None:
    objs = rendered(overlay)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    c = server_container(objs)
    user = re.search(r"^USER (\d+):(\d+)$", dockerfile(overlay), re.M)
    assert user
    sc = pod["securityContext"]
    assert sc["runAsNonRoot"] is True
    assert (sc["runAsUser"], sc["runAsGroup"]) == (int(user.group(1)), int(user.group(2)))
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    csc = c["securityContext"]
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"] == {"drop": ["ALL"]}
    assert not csc.get("privileged")
    # With a read-only root, everything the server writes must land on a volume.
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert set(mounts.values()) <= set(volumes)
    for v in volumes.values():
        assert len(v) == 2, f"volume {v['name']} needs exactly one source: {v}"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert "RINGSERVE_CACHE=/cache" in dockerfile(overlay)
    assert env["RINGSERVE_CACHE"] == "/cache" and "/cache" in mounts
    assert "/tmp" in mounts
    for name in ("RINGSERVE_CACHE", "TORCH_EXTENSIONS_DIR", "TRITON_CACHE_DIR", "HOME"):
        path = Path(env[name])
        assert any(path == Path(m) or Path(m) in path.parents for m in mounts), name


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_hpa_metrics_are_what_the_adapter_serves(overlay: str) -> None:
    objs = rendered(overlay)
    served: dict[str, str] = {}
    for rule in adapter_rules(objs):
        series, name = adapter_metric(rule)
        # A series the server exports: a gauge, which the HPA can average as it is.
        assert series.startswith(metrics.P) and series[len(metrics.P):] in metrics.GAUGES, series
        assert ":" not in name and "/" not in name, f"{name} is no valid custom metric name"
        # The pod each sample came from: the labels the PodMonitor's scrape adds.
        assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"},
                                                   "pod": {"resource": "pod"}}}
        assert all(x in rule["seriesQuery"] for x in ('namespace!=""', 'pod!=""'))
        assert "<<.Series>>" in rule["metricsQuery"] and "<<.GroupBy>>" in rule["metricsQuery"]
        served[name] = series
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": one(objs, "Deployment")["metadata"]["name"]}
    used = {}
    for m in hpa["spec"]["metrics"]:
        assert m["type"] == "Pods", m
        name = m["pods"]["metric"]["name"]
        assert name in served, f"HPA metric {name}: no adapter rule serves it ({sorted(served)})"
        used[served[name]] = float(m["pods"]["target"]["averageValue"])
    assert metrics.P + "num_requests_waiting" in used
    running = used.get(metrics.P + "num_requests_running")
    if running is not None:  # reachable: fewer than --max-num-seqs per replica
        assert running < int(flags(server_container(objs)["args"])["max-num-seqs"])
    pdb = one(objs, "PodDisruptionBudget")
    assert hpa["spec"]["minReplicas"] > pdb["spec"]["maxUnavailable"]


def test_adapter_queries_are_promql(tmp_path: Path) -> None:
    """Each rule's metricsQuery, filled in as the adapter does, parses (promtool)."""
    exprs: list[dict[str, str]] = []
    for rule in adapter_rules(rendered("cpu")):
        series, _ = adapter_metric(rule)
        query = (rule["metricsQuery"].replace("<<.Series>>", series)
                 .replace("<<.LabelMatchers>>", 'namespace="ringserve",pod=~"a|b"')
                 .replace("<<.GroupBy>>", "pod"))
        assert "<<" not in query, query
        exprs.append({"record": f"adapter:expr_{len(exprs)}", "expr": query})
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "adapter", "rules": exprs}]}))
    out = subprocess.run([tool("promtool"), "check", "rules", str(path)], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_session_affinity_hashes_only_requests_with_the_header(overlay: str) -> None:
    objs = rendered(overlay)
    prefix = "nginx.ingress.kubernetes.io/"
    ingresses = find(objs, "Ingress")
    canary = [i for i in ingresses if i["metadata"]["annotations"].get(prefix + "canary")]
    main = [i for i in ingresses if i not in canary]
    assert len(canary) == 1 and len(main) == 1
    a, b = main[0]["metadata"]["annotations"], canary[0]["metadata"]["annotations"]
    # Without the header: the main Ingress, not hashed (an empty key is one replica).
    assert prefix + "upstream-hash-by" not in a
    assert b[prefix + "canary"] == "true"
    assert b[prefix + "canary-by-header"] == SESSION_HEADER
    assert re.fullmatch(b[prefix + "canary-by-header-pattern"], "conversation-1")
    assert not re.fullmatch(b[prefix + "canary-by-header-pattern"], "")
    assert prefix + "canary-weight" not in b  # else headerless requests would be hashed too
    hash_by = b[prefix + "upstream-hash-by"]
    assert hash_by == "$http_" + SESSION_HEADER.lower().replace("-", "_")
    assert re.fullmatch(r"[A-Za-z0-9\-_${}]*", hash_by)  # ingress-nginx's accepted characters
    # A canary only applies to the same host and paths as its main Ingress.
    def rule_keys(ing: Obj) -> list[tuple[str, str, str]]:
        return [(r.get("host", ""), p["path"], p["pathType"])
                for r in ing["spec"]["rules"] for p in r["http"]["paths"]]
    assert rule_keys(main[0]) == rule_keys(canary[0])
    assert main[0]["spec"]["ingressClassName"] == canary[0]["spec"]["ingressClassName"]
    services = {s["metadata"]["name"]: s for s in find(objs, "Service")}
    backends = [i["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"]
                for i in (main[0], canary[0])]
    assert backends[0] != backends[1], "ingress-nginx needs a distinct Service for a canary"
    assert services[backends[0]]["spec"]["selector"] == services[backends[1]]["spec"]["selector"]
    assert nginx_size(a[prefix + "proxy-body-size"]) >= ServeArgs(model="x").max_body_bytes


@pytest.mark.parametrize("overlay", OVERLAYS, ids=IDS)
def test_images_and_devices(overlay: str) -> None:
    objs = rendered(overlay)
    c = server_container(objs)
    pod = one(objs, "Deployment")["spec"]["template"]["spec"]
    compose = "docker-compose.yml" if overlay == "cpu" else "docker-compose.gpu.yml"
    images = re.findall(r"^\s*image: (ringserve:\S+)$", (DOCKER / compose).read_text(), re.M)
    assert c["image"].rsplit("/", 1)[-1] == images[0]  # any registry, compose's name:tag
    gpus = c["resources"].get("limits", {}).get("nvidia.com/gpu")
    assert "memory" in c["resources"]["requests"] and "cpu" in c["resources"]["requests"]
    if overlay == "gpu":
        assert gpus == 1
        assert flags(c["args"])["device"] == "cuda"
        assert any(t["key"] == "nvidia.com/gpu" for t in pod["tolerations"])
    else:
        assert gpus is None and "device" not in flags(c["args"])


def test_shared_cache_component(tmp_path: Path) -> None:
    """components/shared-cache on top of an overlay: one ReadWriteMany claim for /cache."""
    rel = Path(os.path.relpath(K8S, tmp_path))
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "resources": [str(rel / "overlays" / "cpu")],
        "components": [str(rel / "components" / "shared-cache")]}))
    objs = kustomize(tmp_path)
    pvc = one(objs, "PersistentVolumeClaim")
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    deployment = one(objs, "Deployment")
    assert pvc["metadata"]["namespace"] == deployment["metadata"]["namespace"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["cache"] == {"name": "cache", "persistentVolumeClaim": {
        "claimName": pvc["metadata"]["name"]}}
    for obj in objs:
        validate(obj, KUBE_VERSIONS[-1])


def test_every_manifest_says_what_it_is() -> None:
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 10
    for f in files:
        assert f.read_text().startswith("#"), f"{f.relative_to(ROOT)}: start with a comment"
