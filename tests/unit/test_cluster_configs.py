"""Cluster configs: every ``ray up`` file passes Ray's own schema and validator;
the KubeRay manifests have the structure the operator expects. All of them keep
token authentication on, listen on no public address and hold no secrets."""

from __future__ import annotations

import copy
import re
import shlex
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CLUSTER = REPO / "cluster_configs"
RAY_UP = sorted(CLUSTER.glob("*.yaml"))
KUBERAY = CLUSTER / "kuberay"
GPU_INSTANCE = re.compile(r"^(p\d|g\d|a2-|a3-|g2-)")

SECRET_PATTERNS = [
    r"AKIA[0-9A-Z]{16}",  # AWS access key id
    r"(?i)aws_secret_access_key",
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----",
    r"(?i)password\s*[:=]",
    r"(?i)\bRAY_AUTH_TOKEN\s*[:=]\s*[^\s$]",  # a literal token value (not $(...))
    r"\b[0-9a-f]{32,}\b",  # long hex strings look like tokens
]


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def prepared(path: Path) -> dict:
    from ray.autoscaler._private.util import prepare_config

    return prepare_config(copy.deepcopy(load(path)))


SPOT = {"aws_spot": "aws", "gcp_preemptible": "gcp"}
ELASTIC_JOB = KUBERAY / "rayjob_elastic.yaml"


def test_there_is_an_aws_and_a_gcp_config_each_also_on_spot():
    assert {p.stem for p in RAY_UP} == {"aws", "gcp", *SPOT}
    for path in RAY_UP:
        assert load(path)["provider"]["type"] == SPOT.get(path.stem, path.stem)


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_ray_up_config_passes_rays_schema_and_validator(path):
    import jsonschema
    from ray.autoscaler._private.util import validate_config

    validate_config(prepared(path))
    broken = prepared(path)
    broken["max_workerz"] = 1
    with pytest.raises(jsonschema.ValidationError):
        validate_config(broken)


def node_types(path: Path) -> tuple[dict, dict]:
    cfg = load(path)
    types = cfg["available_node_types"]
    head = types[cfg["head_node_type"]]
    (worker,) = [t for name, t in types.items() if name != cfg["head_node_type"]]
    return head, worker


def has_gpus(node_type: dict) -> bool:
    node = node_type["node_config"]
    instance = node.get("InstanceType") or node.get("machineType")
    return bool(
        GPU_INSTANCE.match(instance)
        or node.get("guestAccelerators")
        or node_type.get("resources", {}).get("GPU", 0) > 0
    )


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_cpu_head_and_an_autoscaling_gpu_worker_group(path):
    head, worker = node_types(path)
    assert not has_gpus(head)
    assert has_gpus(worker)
    low = 0 if path.stem not in SPOT else worker["min_workers"]
    assert worker["min_workers"] == low < worker["max_workers"]
    assert load(path)["max_workers"] >= worker["max_workers"]


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_setup_installs_this_checkout_and_mounts_shared_storage(path):
    cfg = load(path)
    assert cfg["file_mounts"]["~/ray_fsdp_backend"] == "."
    setup = " ".join(cfg["setup_commands"])
    assert "pip install -e ~/ray_fsdp_backend" in setup
    assert "/mnt/shared" in setup
    hsdp = load(REPO / "examples" / "hsdp_multinode.yaml")
    assert hsdp["run"]["storage_path"].startswith("/mnt/shared")


@pytest.mark.parametrize("path", RAY_UP, ids=lambda p: p.name)
def test_token_auth_on_and_dashboard_on_loopback(path):
    cfg = prepared(path)  # with Ray's defaults merged in: they bind 0.0.0.0
    head_start = " ".join(cfg["head_start_ray_commands"])
    worker_start = " ".join(cfg["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token ray start --head" in head_start
    assert "RAY_AUTH_MODE=token ray start --address" in worker_start
    assert "--dashboard-host=127.0.0.1" in shlex.split(head_start)
    assert "0.0.0.0" not in yaml.safe_dump(cfg)
    assert "~/.ray/auth_token" in cfg["file_mounts"]  # the token file, not its value


def kuberay_docs() -> dict[str, dict]:
    """The fixed-size manifests by kind (the elastic RayJob is checked on its own)."""
    docs = {}
    for path in sorted(set(KUBERAY.glob("*.yaml")) - {ELASTIC_JOB}):
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


def cluster_specs() -> list[dict]:
    docs = kuberay_docs()
    return [docs["RayCluster"]["spec"], docs["RayJob"]["spec"]["rayClusterSpec"]]


def container(group: dict) -> dict:
    (c,) = group["template"]["spec"]["containers"]
    return c


def test_kuberay_manifests_have_the_expected_kinds():
    docs = kuberay_docs()
    assert set(docs) == {"RayCluster", "RayJob", "PersistentVolumeClaim"}
    for kind in ("RayCluster", "RayJob"):
        assert docs[kind]["apiVersion"] == "ray.io/v1"
        assert docs[kind]["metadata"]["name"]
    assert "ReadWriteMany" in docs["PersistentVolumeClaim"]["spec"]["accessModes"]


@pytest.mark.parametrize("spec", cluster_specs(), ids=["RayCluster", "RayJob"])
def test_kuberay_cluster_spec_head_and_gpu_workers(spec):
    import ray

    assert spec["rayVersion"] == ray.__version__
    assert spec["authOptions"]["mode"] == "token"
    assert spec["enableInTreeAutoscaling"] is True
    head = container(spec["headGroupSpec"])
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    assert spec["headGroupSpec"].get("serviceType", "ClusterIP") == "ClusterIP"
    (gpu,) = spec["workerGroupSpecs"]
    limits = container(gpu)["resources"]["limits"]
    assert int(limits["nvidia.com/gpu"]) == 8
    assert gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    assert gpu["minReplicas"] < gpu["maxReplicas"]
    for group in (spec["headGroupSpec"], gpu):
        mounts = {m["mountPath"] for m in container(group)["volumeMounts"]}
        assert "/mnt/shared" in mounts
        claims = [
            v["persistentVolumeClaim"]["claimName"]
            for v in group["template"]["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        ]
        assert claims == ["ray-fsdp-shared"]


def test_rayjob_entrypoint_trains_a_shipped_config():
    job = kuberay_docs()["RayJob"]["spec"]
    argv = shlex.split(job["entrypoint"])
    assert argv[:2] == ["ray-fsdp", "train"]
    shipped = Path(argv[2]).relative_to("/opt/ray_fsdp_backend")
    assert (REPO / shipped).is_file()
    assert job["shutdownAfterJobFinishes"] is True
    dockerfile = (KUBERAY / "Dockerfile").read_text()
    assert "COPY --chown=ray:users . /opt/ray_fsdp_backend" in dockerfile
    assert "rayproject/ray:2.60.0" in dockerfile


def all_cluster_files() -> list[Path]:
    return [p for p in CLUSTER.rglob("*") if p.is_file()] + [REPO / "examples" / "submit_job.sh"]


@pytest.mark.parametrize("path", all_cluster_files(), ids=lambda p: p.name)
def test_no_secrets_no_public_listeners_no_auth_opt_out(path):
    text = path.read_text()
    for pattern in SECRET_PATTERNS:
        assert not re.search(pattern, text), f"{path.name} matches {pattern}"
    assert "0.0.0.0" not in text
    assert "RAY_AUTH_MODE=disabled" not in text and "mode: disabled" not in text
    assert "LoadBalancer" not in text and "NodePort" not in text and "kind: Ingress" not in text


# -- elastic: spot / preemptible workers, min and max ----------------------


def elastic_example() -> tuple[int, int]:
    low, high = load(REPO / "examples" / "elastic_spot.yaml")["scaling"]["num_workers"]
    return low, high


@pytest.mark.parametrize("stem", sorted(SPOT))
def test_spot_configs_run_the_elastic_example_on_spot_workers(stem):
    path = CLUSTER / f"{stem}.yaml"
    head, worker = node_types(path)
    node = worker["node_config"]
    if SPOT[stem] == "aws":
        assert node["InstanceMarketOptions"]["MarketType"] == "spot"
        assert "InstanceMarketOptions" not in head["node_config"]
    else:
        assert node["scheduling"]["provisioningModel"] == "SPOT"
        assert "scheduling" not in head["node_config"]
    low, high = elastic_example()
    assert (8 * worker["min_workers"], 8 * worker["max_workers"]) == (low, high)
    assert "examples/elastic_spot.yaml" in path.read_text()


def test_elastic_rayjob_trains_the_elastic_example_on_spot_pods():
    (job,) = list(yaml.safe_load_all(ELASTIC_JOB.read_text()))
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    spec = job["spec"]
    test_kuberay_cluster_spec_head_and_gpu_workers(spec["rayClusterSpec"])
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["ray-fsdp", "train", "/opt/ray_fsdp_backend/examples/elastic_spot.yaml"]
    (gpu,) = spec["rayClusterSpec"]["workerGroupSpecs"]
    assert (8 * gpu["minReplicas"], 8 * gpu["maxReplicas"]) == elastic_example()
    assert gpu["template"]["spec"]["nodeSelector"] == {"cloud.google.com/gke-spot": "true"}
    head = spec["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head  # the Train controller stays on on-demand capacity


def test_elastic_example_is_valid_and_its_batch_splits_at_whole_nodes():
    from ray_fsdp_backend.planning.elastic import elastic_world_sizes
    from ray_fsdp_backend.trainer.schema.spec import load_spec

    spec = load_spec(REPO / "examples" / "elastic_spot.yaml")
    low, high = elastic_example()
    fits, _ = elastic_world_sizes(spec.train.global_batch_size, low, high)
    assert set(range(low, high + 1, 8)) <= set(fits)
