"""The Helm chart, linted and rendered offline with each example values file.

Rendering uses helm-python-sdk (Helm's own Go library through ctypes, no binary, no cluster).
Every rendered object is validated: core kinds against the Kubernetes OpenAPI schemas that
kubernetes-validate ships (the oldest version the chart supports and the newest known), the
CRD kinds against the schemas in tests/helm/schemas/, and the pod templates inside a
RayCluster as core PodTemplates. Then the tests assert on the objects themselves.
"""

from __future__ import annotations

import functools
import json
import re
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "wasma"
EXAMPLES = sorted((CHART / "examples").glob("*.yaml"))
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CRD_SCHEMAS = {
    ("ray.io/v1", "RayCluster"): "raycluster-ray-v1.json",
    ("ray.io/v1", "RayService"): "rayservice-ray-v1.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor-monitoring-v1.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule-monitoring-v1.json",
}
# Chart.yaml's kubeVersion floor, and the newest schemas kubernetes-validate has.
KUBE_VERSIONS = ("1.25.0", kubernetes_validate.latest_version())
NAMESPACE = "llm"
RELEASE = "wasma"
Obj = dict[str, Any]


# ---- rendering helpers -------------------------------------------------------------------


def load_values(path: Path) -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load(path.read_text())
    return values


def render(values: dict[str, Any] | None) -> list[Obj]:
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects: list[Obj] = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


@functools.cache
def _render_example(name: str) -> str:
    # Cached as text: each test gets its own parsed copy to mutate freely.
    return yaml.safe_dump_all(render(load_values(CHART / "examples" / name)))


def example(name: str) -> list[Obj]:
    return list(yaml.safe_load_all(_render_example(name)))


def one(objects: list[Obj], kind: str, name_suffix: str = "") -> Obj:
    found = [
        o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)
    ]
    assert len(found) == 1, (kind, name_suffix, [o["metadata"]["name"] for o in found])
    return found[0]


def kinds(objects: list[Obj]) -> set[str]:
    return {o["kind"] for o in objects}


def pod_templates(objects: list[Obj]) -> Iterator[tuple[str, Obj]]:
    """(where, pod template) for every pod the release would create."""
    for o in objects:
        if o["kind"] in ("Deployment", "StatefulSet", "DaemonSet"):
            yield o["metadata"]["name"], o["spec"]["template"]
        if o["kind"] in ("RayCluster", "RayService"):
            spec = o["spec"] if o["kind"] == "RayCluster" else o["spec"]["rayClusterConfig"]
            yield o["metadata"]["name"] + "/head", spec["headGroupSpec"]["template"]
            for group in spec["workerGroupSpecs"]:
                yield o["metadata"]["name"] + "/" + group["groupName"], group["template"]


def gateway_container(objects: list[Obj]) -> Obj:
    containers = [
        c
        for _, template in pod_templates(objects)
        for c in template["spec"]["containers"]
        if c["name"] == "gateway"
    ]
    assert len(containers) == 1
    return containers[0]


def flags(args: list[str]) -> dict[str, str]:
    """`serve --a x --b y` → {"--a": "x", "--b": "y"}; every flag of serve takes a value
    but the switches, which map to ""."""
    assert args[0] == "serve"
    switches = {"--router-in-process"}
    rest = [a for a in args[1:] if a not in switches]
    assert len(rest) % 2 == 0, rest
    pairs = dict(zip(rest[::2], rest[1::2], strict=True))
    pairs.update({a: "" for a in args[1:] if a in switches})
    assert all(flag.startswith("--") for flag in pairs), rest
    assert len(pairs) == len(rest) // 2 + len(set(args) & switches), "a flag is repeated"
    return pairs


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---- lint and validate -------------------------------------------------------------------


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_lint_is_clean(values_file: Path) -> None:
    report = helm.lint(CHART, load_values(values_file), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert report["errors"] == [] and problems == [], report


def test_there_are_ray_and_openai_examples() -> None:
    modes = {bool(load_values(p).get("ray", {}).get("enabled")) for p in EXAMPLES}
    assert modes == {True, False}


@functools.cache
def _crd_validator(file_name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / file_name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate(obj: Obj) -> None:
    key = (obj["apiVersion"], obj["kind"])
    if key in CRD_SCHEMAS:
        _crd_validator(CRD_SCHEMAS[key]).validate(obj)
        return
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_every_rendered_object_validates(values_file: Path) -> None:
    objects = example(values_file.name)
    for obj in objects:
        validate(obj)
    # The pods KubeRay will create are core PodTemplates: validate them as such.
    for where, template in pod_templates(objects):
        pod_template = {
            "apiVersion": "v1",
            "kind": "PodTemplate",
            "metadata": {"name": where.replace("/", "-")},
            "template": template,
        }
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(pod_template, version, strict=True)


def test_validation_catches_mistakes() -> None:
    """The validators used above do reject broken objects (typo'd field, wrong CRD shape)."""
    deployment = one(example("openai.yaml"), "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(deployment)
    ray = one(example("ray.yaml"), "RayCluster")
    ray["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        validate(ray)


# ---- the router gets its flags -----------------------------------------------------------


def test_ray_mode_flags_reach_the_gateway() -> None:
    objects = example("ray.yaml")
    values = load_values(CHART / "examples" / "ray.yaml")
    gateway = gateway_container(objects)
    assert gateway["command"] == ["wasma"]
    got = flags(gateway["args"])
    assert got == {
        "--engines": f"vllm:{values['ray']['engines']['count']}",
        "--model": values["model"]["path"],
        "--policy": values["policy"]["name"],
        "--host": "0.0.0.0",
        "--port": "8000",
        "--config": "/etc/wasma/config.yaml",
        "--address": "auto",
        # Gateway processes joining the cluster share this one router.
        "--shared-router": one(objects, "RayCluster")["metadata"]["name"] + "-router",
    }
    assert {"Deployment", "HorizontalPodAutoscaler"}.isdisjoint(kinds(objects))


def test_openai_mode_flags_and_engine_urls() -> None:
    objects = example("openai.yaml")
    got = flags(gateway_container(objects)["args"])
    assert got["--engines"] == "openai:" + ",".join(
        [
            "http://vllm-extra.llm.svc.cluster.local:8000",
            "http://vllm-0.vllm.llm.svc.cluster.local:8000",
            "http://vllm-1.vllm.llm.svc.cluster.local:8000",
            "http://vllm-2.vllm.llm.svc.cluster.local:8000",
        ]
    )
    assert got["--policy"] == "prefix_aware"
    assert got["--api-key-file"] == "/var/run/secrets/wasma/api-keys"
    # The tokenizer the gateway needs, and no local Ray in gateway mode.
    assert got["--model"] == "/models/llama-3.1-8b-instruct"
    assert "--router-in-process" in got and "--address" not in got
    assert "RayCluster" not in kinds(objects)
    gateway = gateway_container(objects)
    assert any(m["mountPath"] == "/models" for m in gateway["volumeMounts"])


def test_policy_params_reach_the_config_file() -> None:
    objects = example("openai.yaml")
    config = yaml.safe_load(one(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    assert config["policy"] == {
        "name": "prefix_aware",
        "params": {"balance_abs_threshold": 32, "balance_rel_threshold": 1.5},
    }
    # `wasma serve --config` reads exactly this file.
    from wasma.deploy.serve import load_config_file

    path = Path(tempfile.mkdtemp()) / "config.yaml"
    path.write_text(one(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    loaded = load_config_file(str(path))
    assert loaded["params"] == config["policy"]["params"]
    assert loaded["policy_name"] == flags(gateway_container(objects)["args"])["--policy"]
    # The file the flag names is the ConfigMap, mounted where the flag says.
    gateway = gateway_container(objects)
    mount = next(m for m in gateway["volumeMounts"] if m["name"] == "config")
    assert mount["mountPath"] + "/config.yaml" == flags(gateway["args"])["--config"]


def test_extra_args_and_port_override() -> None:
    values = load_values(CHART / "examples" / "ray.yaml")
    values["gateway"] = {"port": 9001, "extraArgs": ["--profile", "llama3-8b-h100"]}
    objects = render(values)
    gateway = gateway_container(objects)
    got = flags(gateway["args"])
    assert got["--port"] == "9001" and got["--profile"] == "llama3-8b-h100"
    assert gateway["ports"] == [{"name": "http", "containerPort": 9001, "protocol": "TCP"}]
    assert one(objects, "Service")["spec"]["ports"][0]["targetPort"] == "http"


# ---- secrets ------------------------------------------------------------------------------


def all_envs(objects: list[Obj]) -> Iterator[Obj]:
    for _, template in pod_templates(objects):
        for container in template["spec"]["containers"]:
            yield from container.get("env", [])


def test_api_keys_come_from_the_secret_by_reference() -> None:
    objects = example("ray.yaml")
    assert "Secret" not in kinds(objects)
    keys = [e for e in all_envs(objects) if e["name"] == "WASMA_API_KEYS"]
    assert keys == [
        {
            "name": "WASMA_API_KEYS",
            "valueFrom": {"secretKeyRef": {"name": "wasma-api-keys", "key": "api-keys"}},
        }
    ]

    objects = example("openai.yaml")  # mountAsFile: the keys never enter the environment
    assert not [e for e in all_envs(objects) if e["name"] == "WASMA_API_KEYS"]
    template = one(objects, "Deployment")["spec"]["template"]["spec"]
    volume = next(v for v in template["volumes"] if v["name"] == "api-keys")
    assert volume["secret"]["secretName"] == "wasma-api-keys"
    assert volume["secret"]["defaultMode"] & 0o007 == 0  # not world-readable


def test_there_is_no_way_to_inline_a_key() -> None:
    values = load_values(CHART / "examples" / "openai.yaml")
    values["apiKeys"]["value"] = "sk-very-secret"
    with (
        helm.Chart.load(CHART) as chart,
        pytest.raises(helm.HelmError, match="'value' not allowed"),
    ):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    # And what the chart renders never carries a literal key or a Secret of its own.
    for obj in example("openai.yaml") + example("ray.yaml"):
        assert obj["kind"] != "Secret"
        assert "sk-" not in yaml.safe_dump(obj)


def test_hf_token_only_by_reference() -> None:
    values = load_values(CHART / "examples" / "ray.yaml")
    values["model"]["hfTokenSecret"] = {"name": "hf", "key": "token"}
    env = [e for e in all_envs(render(values)) if e["name"] == "HF_TOKEN"]
    assert env == [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    ]


# ---- selectors ------------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_selectors_match_pod_labels(values_file: Path) -> None:
    objects = example(values_file.name)
    templates = dict(pod_templates(objects))
    labels = {where: t["metadata"]["labels"] for where, t in templates.items()}
    service = one(objects, "Service")
    gateway_pods = [w for w, lab in labels.items() if matches(service["spec"]["selector"], lab)]
    # Exactly the pod template that serves the API: the gateway container's, or in
    # RayService mode the Ray head's, whose Serve proxy listens on the port named http.
    assert gateway_pods == [
        w
        for w, t in templates.items()
        if any(
            c["name"] == "gateway" or any(p.get("name") == "http" for p in c.get("ports", []))
            for c in t["spec"]["containers"]
        )
    ]
    for deployment in (o for o in objects if o["kind"] == "Deployment"):
        assert matches(
            deployment["spec"]["selector"]["matchLabels"],
            deployment["spec"]["template"]["metadata"]["labels"],
        )
    pdb = one(objects, "PodDisruptionBudget")
    assert [w for w, lab in labels.items() if matches(pdb["spec"]["selector"]["matchLabels"], lab)]
    policy = one(objects, "NetworkPolicy")
    selected = [
        w for w, lab in labels.items() if matches(policy["spec"]["podSelector"]["matchLabels"], lab)
    ]
    assert sorted(selected) == sorted(labels)  # every pod of the release is covered
    if not any(o["kind"] == "ServiceMonitor" for o in objects):
        # Only the RayService example goes without: Ray Serve has no wasma /metrics.
        assert one(objects, "RayService")
        return
    monitor = one(objects, "ServiceMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {
        p["name"] for p in service["spec"]["ports"]
    }
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_ray_pdb_guards_engines_and_hpa_targets_gateway() -> None:
    ray = example("ray.yaml")
    pdb = one(ray, "PodDisruptionBudget")
    engines = one(ray, "RayCluster")["spec"]["workerGroupSpecs"][0]["template"]
    assert matches(pdb["spec"]["selector"]["matchLabels"], engines["metadata"]["labels"])

    openai = example("openai.yaml")
    hpa = one(openai, "HorizontalPodAutoscaler")
    deployment = one(openai, "Deployment")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert "replicas" not in deployment["spec"]  # the HPA owns the count
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 6)


def test_volume_mounts_and_config_maps_resolve() -> None:
    for name in ("ray.yaml", "openai.yaml"):
        objects = example(name)
        config_maps = {o["metadata"]["name"] for o in objects if o["kind"] == "ConfigMap"}
        for where, template in pod_templates(objects):
            volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
            for container in template["spec"]["containers"]:
                for mount in container.get("volumeMounts", []):
                    assert mount["name"] in volumes, (where, container["name"], mount["name"])
            for volume in volumes.values():
                if "configMap" in volume:
                    assert volume["configMap"]["name"] in config_maps


# ---- security ------------------------------------------------------------------------------


@pytest.mark.parametrize("values_file", EXAMPLES, ids=lambda p: p.name)
def test_every_container_is_locked_down(values_file: Path) -> None:
    objects = example(values_file.name)
    for where, template in pod_templates(objects):
        pod = template["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True, where
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (where, container["name"])
            assert sc["readOnlyRootFilesystem"] is True, (where, container["name"])
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert sc.get("privileged", False) is False
            # A read-only root needs a writable /tmp (Python, Ray, vLLM caches).
            assert "/tmp" in {m["mountPath"] for m in container["volumeMounts"]}


def test_schema_refuses_root_and_unknown_keys() -> None:
    base = load_values(CHART / "examples" / "openai.yaml")
    bad_values: list[dict[str, Any]] = [
        {"securityContext": {"runAsNonRoot": False}},
        {"securityContext": {"allowPrivilegeEscalation": True}},
        {"policy": {"name": "fastest"}},
        {"gatway": {"port": 8000}},
        {"openai": {"urls": ["vllm-0:8000"]}},  # a URL needs its scheme
        # ray mode without model.path
        {"ray": {"enabled": True}, "model": {"path": "", "mountPath": "/models", "volume": {}}},
    ]
    with helm.Chart.load(CHART) as chart:
        for bad in bad_values:
            with pytest.raises(helm.HelmError):
                chart.validate_schema({**base, **bad})
        chart.validate_schema(base)


def test_openai_mode_without_engines_fails_clearly() -> None:
    with pytest.raises(helm.HelmError, match=r"openai\.urls or openai\.statefulSet"):
        render(None)


def test_liveness_and_readiness_are_split() -> None:
    gateway = gateway_container(example("openai.yaml"))
    # Liveness is the process only: an engine rollout does not restart the gateways.
    assert gateway["livenessProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert gateway["startupProbe"]["httpGet"] == {"path": "/live", "port": "http"}
    assert gateway["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}


def test_shutdown_is_sized_for_long_streams() -> None:
    objects = example("openai.yaml")
    pod = one(objects, "Deployment", "-gateway")["spec"]["template"]["spec"]
    gateway = gateway_container(objects)
    assert gateway["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    config = yaml.safe_load(one(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    drain = config["lifecycle"]
    assert drain == {"drain_delay_s": 5, "drain_timeout_s": 600}
    # Kubernetes waits for preStop, the drain's delay and its streams, plus slack.
    assert pod["terminationGracePeriodSeconds"] == 5 + 5 + 600 + 10
    values = load_values(CHART / "examples" / "openai.yaml")
    values["gateway"] = {"drain": {"delaySeconds": 2, "timeoutSeconds": 3600}}
    pod = one(render(values), "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] == 5 + 2 + 3600 + 10
    # `wasma serve` takes the lifecycle section the chart writes.
    from wasma.deploy.serve import load_config_file

    path = Path(tempfile.mkdtemp()) / "config.yaml"
    path.write_text(one(objects, "ConfigMap", "-config")["data"]["config.yaml"])
    assert load_config_file(str(path))["lifecycle"] == drain


def test_monitoring_reaches_across_namespaces_and_carries_the_release_label() -> None:
    objects = example("openai.yaml")
    policy = one(objects, "NetworkPolicy")
    peers = [peer for rule in policy["spec"]["ingress"] for peer in rule.get("from", [])]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    } in peers
    for kind in ("ServiceMonitor", "PrometheusRule"):
        assert one(objects, kind)["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_ray_engines_get_their_gpus() -> None:
    values = load_values(CHART / "examples" / "ray.yaml")
    values["ray"]["engines"]["gpusPerEngine"] = 2
    cluster = one(render(values), "RayCluster")
    group = cluster["spec"]["workerGroupSpecs"][0]
    count = values["ray"]["engines"]["count"]
    assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == count
    assert group["rayStartParams"]["num-gpus"] == "2"
    worker = group["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert worker["resources"]["limits"]["memory"] == "64Gi"
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    # The head's first container is the Ray one (KubeRay starts Ray in container 0).
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in head] == ["ray-head", "gateway"]
    # Both share Ray's session directory, so the gateway can attach as a driver.
    for container in head:
        assert {"name": "ray-session", "mountPath": "/tmp/ray"} in container["volumeMounts"]


# ---- dashboard and rules ship with the chart --------------------------------------------


@pytest.mark.parametrize(
    ("chart_copy", "original"),
    [
        ("files/wasma-dashboard.json", "deploy/grafana/wasma-dashboard.json"),
        ("files/rules.yaml", "deploy/prometheus/rules.yaml"),
    ],
)
def test_chart_copies_equal_deploy_originals(chart_copy: str, original: str) -> None:
    # Symlinks do not survive `helm package`, so the chart carries copies.
    assert (CHART / chart_copy).read_bytes() == (REPO / original).read_bytes(), (
        f"run: cp {original} helm/wasma/{chart_copy}"
    )


def test_dashboard_and_rules_objects() -> None:
    objects = example("ray.yaml")
    dashboard = one(objects, "ConfigMap", "-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(dashboard["data"]["wasma-dashboard.json"])
    assert shipped == json.loads((REPO / "deploy/grafana/wasma-dashboard.json").read_text())
    rule = one(objects, "PrometheusRule")
    assert rule["spec"] == yaml.safe_load((REPO / "deploy/prometheus/rules.yaml").read_text())
    assert (
        one(example("openai.yaml"), "ConfigMap", "-dashboard")["metadata"]["namespace"]
        == "monitoring"
    )


def test_packaged_chart_carries_dashboard_and_rules(tmp_path: Path) -> None:
    archive = helm.package(CHART, destination=tmp_path)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for path in ("files/wasma-dashboard.json", "files/rules.yaml", "values.schema.json"):
        assert f"wasma/{path}" in names
    with helm.Chart.load(archive) as packaged:
        manifests = packaged.render(
            load_values(CHART / "examples" / "ray.yaml"), name=RELEASE, namespace=NAMESPACE
        )
    assert any("wasma-dashboard.json" in text for text in manifests.values())


# ---- the image the chart runs ---------------------------------------------------------------


def test_dockerfile_matches_the_chart() -> None:
    dockerfile = (REPO / "deploy" / "Dockerfile").read_text()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", dockerfile, flags=re.MULTILINE))
    # Ray refuses nodes of another version: the image's Ray is the RayCluster's rayVersion.
    assert args["RAY_VERSION"] == values["ray"]["rayVersion"]
    # The image's user is the one the pods run as, and it is not root.
    assert args["UID"] == str(values["podSecurityContext"]["runAsUser"]) != "0"
    assert re.search(r"^USER \$\{UID\}:\$\{GID\}$", dockerfile, flags=re.MULTILINE)
    # Every package the distribution ships (the import root's links) is copied into each
    # image: a floor left out fails the image's `wasma --help` at build time.
    packages = {p.name for p in (REPO / "wasma").iterdir() if p.is_symlink()}
    assert {"core", "scheduler", "deploy"} <= packages
    stages = re.split(r"^FROM ", dockerfile, flags=re.MULTILINE)[1:]
    assert len(stages) == 2  # gateway, engine
    for stage in stages:
        copied = set(re.findall(r"^COPY (\S+)/ ", stage, flags=re.MULTILINE))
        assert packages | {"wasma"} <= copied, (stage.split()[2], packages - copied)
        for source in copied:
            assert (REPO / source).is_dir(), source


def test_rayservice_runs_wasma_ray_serve() -> None:
    objects = example("rayservice.yaml")
    assert "RayCluster" not in kinds(objects)  # KubeRay makes the cluster from the service
    service = one(objects, "RayService")
    config = yaml.safe_load(service["spec"]["serveConfigV2"])
    (app,) = config["applications"]
    assert app["import_path"] == "wasma.ray_serve.app:build_openai_app"
    (llm,) = app["args"]["llm_configs"]
    assert llm["deployment_config"]["num_replicas"] == 4
    assert llm["model_loading_config"] == {
        "model_id": "llama-3-8b",
        "model_source": "/models/Meta-Llama-3-8B-Instruct",
    }
    assert llm["engine_kwargs"]["max_model_len"] == 8192
    assert app["args"]["wasma"]["policy"] == "wasma"
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    # No wasma gateway beside Serve: Ray's proxy on the head answers on port http.
    assert [c["name"] for c in head["containers"]] == ["ray-head"]
    assert {"name": "http", "containerPort": 8000} in head["containers"][0]["ports"]
