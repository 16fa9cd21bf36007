"""The production stack under infra/, checked without Docker: the compose file parses, has its services,
takes every secret from the environment (required, never a literal), pins its images to the versions in
constraints.txt; the training image is pinned and non-root; the env example covers every variable.
`docker compose config` runs only where the compose plugin is installed."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
INFRA = REPO / "infra"
COMPOSE = INFRA / "docker-compose.yml"
SERVICES = {"postgres", "prefect-server", "mlflow-server"}
# ${NAME}, ${NAME:-default}, ${NAME-default}, ${NAME:?message}, ${NAME?message}
INTERPOLATION = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|CREDENTIAL|(^|_)KEY(_|$)|ACCESS_KEY", re.IGNORECASE)
SECRET_KEY = re.compile(r"password|secret|token", re.IGNORECASE)
URL_PASSWORD = re.compile(r"://[^:/@\s]+:(.+?)@")


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if "==" in line and not line.lstrip().startswith("#"):
            name, version = line.split("==", 1)
            out[name.strip().lower()] = version.strip()
    return out


def strings(node, path: str = ""):
    """Every (path, key, string) in a parsed YAML tree; key is the mapping key the string sits under."""
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, (dict, list)):
                yield from strings(v, f"{path}.{k}")
            elif isinstance(v, str):
                yield f"{path}.{k}", str(k), v
    elif isinstance(node, list):
        for i, v in enumerate(node):
            if isinstance(v, (dict, list)):
                yield from strings(v, f"{path}[{i}]")
            elif isinstance(v, str):
                key, _, value = v.partition("=")  # `environment:` as a list of KEY=VALUE
                yield f"{path}[{i}]", key if _ else "", value if _ else v


def interpolations() -> list[tuple[str, str, str]]:
    """(name, operator, where) for every ${...} in the compose file."""
    return [(m.group(1), m.group(2) or "", where) for where, _, s in strings(compose())
            for m in INTERPOLATION.finditer(s)]


def env_example() -> dict[str, str]:
    out = {}
    for line in (INFRA / ".env.example").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, value = line.partition("=")
            assert sep, f"not NAME=value: {line!r}"
            out[name.strip()] = value.strip()
    return out


def image_tag(image: str) -> str:
    ref = image.split("@", 1)[0]
    last = ref.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else ""


def from_images(dockerfile: Path) -> list[str]:
    return [line.split()[1] for line in dockerfile.read_text().splitlines()
            if line.strip().upper().startswith("FROM ")]


def test_compose_parses_and_has_the_services():
    doc = compose()
    assert set(doc["services"]) >= SERVICES, sorted(doc["services"])
    assert "postgres-data" in doc["volumes"]
    pg = doc["services"]["postgres"]
    assert any(v.startswith("postgres-data:") for v in pg["volumes"])
    assert pg["healthcheck"]["test"]
    for name in ("prefect-server", "mlflow-server"):
        assert doc["services"][name]["depends_on"]["postgres"]["condition"] == "service_healthy"


def test_services_are_wired_as_documented():
    s = compose()["services"]
    assert s["prefect-server"]["command"][:3] == ["prefect", "server", "start"]
    assert "0.0.0.0" in s["prefect-server"]["command"]
    assert s["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://prefect:")
    assert "4200:4200" in s["prefect-server"]["ports"]
    mlflow = s["mlflow-server"]
    cmd = mlflow["command"]
    assert cmd[:2] == ["mlflow", "server"] and "--serve-artifacts" in cmd
    assert cmd[cmd.index("--artifacts-destination") + 1].startswith("s3://${MLFLOW_ARTIFACT_BUCKET:?")
    # the driver named: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, not in the image
    assert mlflow["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://mlflow:")
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "MLFLOW_S3_ENDPOINT_URL"} <= set(mlflow["environment"])
    assert "5000:5000" in mlflow["ports"]
    assert "ports" not in s["postgres"], "the database is reachable from the compose network only"


def test_postgres_init_script_creates_both_databases():
    script = INFRA / "postgres" / "init-databases.sh"
    assert os.access(script, os.X_OK), "the postgres entrypoint runs *.sh that are executable, sources the rest"
    mounts = compose()["services"]["postgres"]["volumes"]
    assert "./postgres/init-databases.sh:/docker-entrypoint-initdb.d/init-databases.sh:ro" in mounts
    text = script.read_text()
    assert "create_database prefect " in text and "create_database mlflow " in text
    assert "pg_trgm" in text  # Prefect's migrations need it
    env = compose()["services"]["postgres"]["environment"]
    for var in re.findall(r"\$\{?([A-Z_]+_DB_PASSWORD)", text):
        assert var in env, f"init-databases.sh reads {var}, which the postgres service does not get"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr


def test_every_secret_is_required_from_the_environment():
    found = [(name, op, where) for name, op, where in interpolations() if SECRET_NAME.search(name)]
    assert {"POSTGRES_PASSWORD", "PREFECT_DB_PASSWORD", "MLFLOW_DB_PASSWORD", "AWS_SECRET_ACCESS_KEY"} <= {
        name for name, _, _ in found}
    loose = [f"{name} at {where} uses '{op or 'no operator'}'" for name, op, where in found if op != ":?"]
    assert not loose, "secrets must use ${VAR:?message}: " + "; ".join(loose)


def test_no_literal_secret_values():
    bad = []
    for where, key, value in strings(compose()):
        if SECRET_KEY.search(key) and not re.fullmatch(r"\$\{[^}]+\}", value.strip()):
            bad.append(f"{where}: {key} is not an interpolation")
        for m in URL_PASSWORD.finditer(value):
            if not re.fullmatch(r"\$\{[^}]+\}", m.group(1)):
                bad.append(f"{where}: password {m.group(1)!r} in a URL")
    assert not bad, bad


def test_images_are_pinned():
    s = compose()["services"]
    for name, svc in s.items():
        assert "image" in svc, f"{name} has no image"
        tag = image_tag(svc["image"])
        assert tag and tag != "latest", f"{name}: {svc['image']} is not pinned"
    for dockerfile in (INFRA / "Dockerfile", INFRA / "mlflow" / "Dockerfile"):
        images = from_images(dockerfile)
        assert images, f"{dockerfile} has no FROM"
        for image in images:
            tag = image_tag(image)
            assert tag and tag != "latest" and re.search(r"\d", tag), f"{dockerfile}: FROM {image} is not pinned"


def test_server_versions_equal_the_constraints():
    p = pins()
    s = compose()["services"]
    assert s["prefect-server"]["image"] == f"prefecthq/prefect:{p['prefect']}-python3.11"
    assert image_tag(s["mlflow-server"]["image"]) == p["mlflow"]
    assert s["mlflow-server"]["build"]["context"] == "./mlflow"
    mlflow_dockerfile = INFRA / "mlflow" / "Dockerfile"
    assert from_images(mlflow_dockerfile) == [f"ghcr.io/mlflow/mlflow:v{p['mlflow']}"]
    text = mlflow_dockerfile.read_text()
    assert f"boto3=={p['boto3']}" in text
    assert re.search(r"psycopg2-binary==\d+\.\d+\.\d+", text)


def test_training_image_is_pinned_non_root_and_keeps_the_base_torch():
    text = (INFRA / "Dockerfile").read_text()
    (base,) = from_images(INFRA / "Dockerfile")
    assert base.startswith(("pytorch/pytorch:", "nvcr.io/nvidia/pytorch:")), base
    users = [line.split()[1] for line in text.splitlines() if line.strip().upper().startswith("USER ")]
    assert users and users[-1] not in {"root", "0", "0:0"}, users
    assert "WORKDIR /workspace/longlive" in text
    assert "pip install --no-deps" in text
    assert not re.search(r"^\s*(ENV|ARG)\s+\S*(PASSWORD|SECRET|TOKEN|ACCESS_KEY)", text, re.MULTILINE | re.IGNORECASE)
    # the constraints filter the image applies: torch and the CUDA stack come from the base
    pattern = re.search(r"grep -viE '([^']+)' constraints\.txt", text).group(1)
    kept = [line for line in (REPO / "constraints.txt").read_text().splitlines()
            if not re.search(pattern, line, re.IGNORECASE)]
    names = {line.split("==")[0].lower() for line in kept if "==" in line}
    assert not names & {"torch", "torchvision", "triton"}
    assert not [n for n in names if n.startswith(("nvidia-", "cuda-"))]
    assert {"mlflow", "prefect", "dvc", "av", "diffusers"} <= names


def test_training_image_requirements_command(tmp_path):
    """The Dockerfile's own one-liner turns pyproject's dependencies into requirements less torch."""
    text = (INFRA / "Dockerfile").read_text()
    cmd = re.search(r'(python -c "import re, tomllib;.*?")\s*\\\n', text, re.DOTALL).group(1)
    cmd = cmd.replace("python -c", f"{sys.executable} -c", 1)
    proc = subprocess.run(["bash", "-c", cmd], cwd=REPO, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    reqs = proc.stdout.split()
    assert "torch" not in reqs and "torchvision" not in reqs
    assert {"mlflow", "prefect", "dvc", "av"} <= set(reqs)


def test_env_example_lists_every_variable_and_holds_no_secret():
    example = env_example()
    used = {name for name, _, _ in interpolations()}
    assert used <= set(example), f"missing from infra/.env.example: {sorted(used - set(example))}"
    for name, value in example.items():
        if SECRET_NAME.search(name):
            assert value.startswith("change-me"), f"{name} in .env.example must be a placeholder"


def test_env_file_and_build_context_exclusions():
    if shutil.which("git") and (REPO / ".git").exists():
        proc = subprocess.run(["git", "check-ignore", "-q", "infra/.env"], cwd=REPO, check=False)
        assert proc.returncode == 0, "infra/.env must be git-ignored"
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", ".venv", "data", "models", "checkpoints", "mlruns", "mlflow.db", "dist", "reports", "logs",
            "infra/.env"} <= ignored


def _compose_plugin() -> bool:
    if not shutil.which("docker"):
        return False
    proc = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True, check=False)
    return proc.returncode == 0


def test_docker_compose_config(tmp_path):
    if not _compose_plugin():
        pytest.skip("docker compose is not installed here; the YAML checks above stand in for it")
    env = {k: v for k, v in os.environ.items() if k not in env_example()}
    base = ["docker", "compose", "-f", str(COMPOSE)]
    proc = subprocess.run([*base, "--env-file", str(INFRA / ".env.example"), "config", "-q"], env=env,
                          capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    # with an empty env file every required secret is missing: compose refuses
    empty = tmp_path / "empty.env"
    empty.write_text("")
    proc = subprocess.run([*base, "--env-file", str(empty), "config", "-q"], env=env, capture_output=True,
                          text=True, check=False)
    out = proc.stderr + proc.stdout
    assert proc.returncode != 0 and any(name in out for name, op, _ in interpolations() if op == ":?"), out


def test_the_vbench_environment_script_parses_and_pins_what_vbench_needs():
    script = INFRA / "vbench" / "make_env.sh"
    assert os.access(script, os.X_OK)
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True, check=False).returncode == 0
    pins = dict(line.split("==") for line in (INFRA / "vbench" / "requirements.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    assert pins["vbench"] == "0.1.5" and pins["transformers"] == "4.33.2" and int(pins["numpy"].split(".")[0]) < 2


def test_a_slurm_left_on_the_ports_is_named_before_the_local_cluster_starts(tmp_path):
    """A cluster left running by a killed test run holds the ports; starting another used to fail with
    slurm's "Invalid node state specified", which names neither the port nor the daemon."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = dict(os.environ, LONGLIVE_SLURM_DIR=str(tmp_path / "slurm"), LONGLIVE_SLURMCTLD_PORT=str(port),
                   LONGLIVE_SLURMD_PORT=str(port))
        proc = subprocess.run(["bash", str(REPO / "infra/slurm/local_cluster.sh"), "start"], env=env,
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"port {port} is in use: another Slurm (or something else) listens there" in proc.stderr
    assert "LONGLIVE_SLURMCTLD_PORT and LONGLIVE_SLURMD_PORT" in proc.stderr
    assert not (tmp_path / "slurm" / "slurm.conf").exists()  # nothing started, nothing written
