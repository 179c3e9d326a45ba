"""The Kubernetes manifests of deploy/kubernetes: valid against the Kubernetes API schemas
(kubernetes-validate's bundled, strict: unknown fields refused; offline), and right for
tierkv: one server per node sharing its pool and socket with the engine pods, probes on
/healthcheck, command lines the real CLI accepts, a vLLM pod configured as the README says.
"""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import kubernetes_validate
import pytest
import yaml

from support.deploy_kit import KUBERNETES, command_config, manifests
from tierkv.config import ServerConfig
from tierkv.controller.config import ControllerConfig

KUBERNETES_VERSION = "1.30"  # the oldest release still maintained upstream when written
SOCKETS = "/run/tierkv"  # the socket directory on the host, mounted at the same path
HTTP_PORT = 8791  # the server's default --http-port
# What the connector needs, from the README's vLLM section (the endpoint is the node's).
KV_TRANSFER = {
    "kv_connector": "TierKVConnector",
    "kv_connector_module_path": "tierkv.integrations.vllm",
    "kv_role": "kv_both",
}
ENV = {"TIERKV_AUTH_TOKEN": "secret-from-tierkv-auth"}


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Any network connection is an error (the schemas must come from the package)."""

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(f"network access: {args} {kwargs}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    yield


def one(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for docs in manifests().values() for d in docs if d["kind"] == kind]
    assert found["metadata"]["name"] == name
    return found


def pod_spec(obj: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = (
        obj["spec"]["template"]["spec"] if "template" in obj["spec"] else obj["spec"]
    )
    return spec


def container_argv(container: dict[str, Any], env: dict[str, str]) -> list[str]:
    """The container's command line as the kubelet gives it: $(VAR) from the environment."""
    argv = [*container.get("command", []), *container.get("args", [])]
    for name, value in env.items():
        argv = [a.replace(f"$({name})", value) for a in argv]
    return argv


def host_path_mounts(spec: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """Mount path -> host path of the container's hostPath volumes."""
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    return {
        m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
        for m in container.get("volumeMounts", [])
        if "hostPath" in volumes[m["name"]]
    }


def test_every_manifest_is_valid_against_the_kubernetes_schemas(offline: None) -> None:
    kinds = []
    for name, docs in manifests().items():
        assert docs, name
        for doc in docs:
            version = kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
            assert version == KUBERNETES_VERSION, (name, doc["kind"])
            kinds.append(doc["kind"])
    assert sorted(kinds) == ["DaemonSet", "Deployment", "Namespace", "Pod", "Service"]


def test_the_schema_check_refuses_a_misspelt_field(offline: None) -> None:
    daemonset = one("DaemonSet", "tierkv-server")
    spec = pod_spec(daemonset)
    spec["hostIpc"] = spec.pop("hostIPC")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, KUBERNETES_VERSION, strict=True)


def test_the_kustomization_names_every_manifest_but_the_example() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == sorted(
        name for name in manifests() if name != "vllm-example-pod.yaml"
    )


@pytest.mark.processes
def test_kubectl_builds_the_kustomization() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(
        [kubectl, "kustomize", str(KUBERNETES)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout))
    assert kinds == ["DaemonSet", "Deployment", "Namespace", "Service"]


def test_the_daemonset_shares_the_pool_and_the_sockets_with_the_node() -> None:
    spec = pod_spec(one("DaemonSet", "tierkv-server"))
    # The pool is a POSIX segment in /dev/shm that engines in other pods map by name:
    # with hostIPC both see the host's /dev/shm (a pod's own /dev/shm is private to it).
    assert spec["hostIPC"] is True
    (server,) = spec["containers"]
    env = {"POD_IP": "10.0.0.7", **ENV}
    cfg = command_config(container_argv(server, env)[1:], ENV)
    assert isinstance(cfg, ServerConfig) and cfg.auth_token == ENV["TIERKV_AUTH_TOKEN"]
    # The socket lives in a host directory, mounted at the same path.
    mounts = host_path_mounts(spec, server)
    assert mounts[SOCKETS] == SOCKETS and cfg.resolved_runtime_dir.startswith(SOCKETS + "/")
    # The disk tier and the quota file are on the host too (they outlive the pod).
    for tier in cfg.tiers:
        assert any(str(tier.options["path"]).startswith(m + "/") for m in mounts), tier
    assert any(cfg.resolved_quota_file.startswith(m + "/") for m in mounts)
    # The cluster through the controller's Service, advertising the pod's address.
    service = one("Service", "tierkv-controller")
    assert cfg.controller == "tierkv-controller.tierkv.svc.cluster.local:8800"
    assert 8800 in [p["port"] for p in service["spec"]["ports"]]
    assert cfg.cluster_advertise == "10.0.0.7" and cfg.cluster_host == "0.0.0.0"
    # The pool's memory is charged to the server: its limit covers the pool.
    limit = server["resources"]["limits"]["memory"]
    assert limit.endswith("Gi") and int(limit[:-2]) * 2**30 > cfg.pool_size
    assert_probes(server, cfg.http_port)
    assert cfg.http_host == "0.0.0.0"  # the kubelet probes the pod's address


def assert_probes(container: dict[str, Any], http_port: int) -> None:
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        assert get["path"] == "/healthcheck", probe
        assert ports.get(get["port"], get["port"]) == http_port, probe


def test_the_controller_runs_as_its_command_line_says() -> None:
    deployment = one("Deployment", "tierkv-controller")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"  # never two at once
    (container,) = pod_spec(deployment)["containers"]
    cfg = command_config(container_argv(container, ENV)[1:], ENV)
    assert isinstance(cfg, ControllerConfig)
    assert_probes(container, cfg.http_port)
    service = one("Service", "tierkv-controller")
    ports = {p["containerPort"] for p in container["ports"]}
    assert {cfg.port, cfg.http_port} <= ports
    assert {p["port"] for p in service["spec"]["ports"]} == {cfg.port, cfg.http_port}
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()


def test_the_command_line_check_refuses_a_renamed_flag() -> None:
    (server,) = pod_spec(one("DaemonSet", "tierkv-server"))["containers"]
    argv = container_argv(server, {"POD_IP": "10.0.0.7"})[1:]
    renamed = [a.replace("--pool-size=", "--pool-siz=") for a in argv]
    with pytest.raises(AssertionError, match="refuses"):
        command_config(renamed, ENV)


def secret_of(container: dict[str, Any], name: str) -> dict[str, str]:
    """The secret key the container's environment variable ``name`` is taken from."""
    (ref,) = [e["valueFrom"]["secretKeyRef"] for e in container["env"] if e["name"] == name]
    return dict(ref)


def test_the_vllm_pod_reaches_the_nodes_server() -> None:
    daemonset = pod_spec(one("DaemonSet", "tierkv-server"))
    (server,) = daemonset["containers"]
    cfg = command_config(container_argv(server, {"POD_IP": "10.0.0.7"})[1:], ENV)
    assert isinstance(cfg, ServerConfig)
    pod = one("Pod", "vllm-tierkv-example")
    spec = pod_spec(pod)
    assert spec["hostIPC"] is True  # the host's /dev/shm, where the pool is
    (vllm,) = spec["containers"]
    assert host_path_mounts(spec, vllm)[SOCKETS] == SOCKETS
    # Same user as the server: the socket and the segment are 0600.
    assert vllm["securityContext"]["runAsUser"] == server["securityContext"]["runAsUser"]
    # The connector's configuration, as the README's vLLM section gives it.
    argv = container_argv(vllm, {})
    assert argv[:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    config = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert {k: config[k] for k in KV_TRANSFER} == KV_TRANSFER
    endpoint = config["kv_connector_extra_config"]["endpoint"]
    assert endpoint == cfg.rpc_endpoint, shlex.join(argv)
    # The server's token, from the same secret.
    assert secret_of(vllm, "TIERKV_AUTH_TOKEN") == secret_of(server, "TIERKV_AUTH_TOKEN")
    assert (
        pod["metadata"]["namespace"] == one("DaemonSet", "tierkv-server")["metadata"]["namespace"]
    )
