"""One MLflow run per stage run, that never breaks the stage.

Every call goes through ``_safe``: the first failure (store unreachable, disk full, a bad value)
is logged once as a warning, tracking is switched off for the rest of the run and the stage
carries on. The store is the ``tracking`` section of params.yaml, or ``MLFLOW_TRACKING_URI``
when set; credentials for a remote store come from MLflow's own environment variables, never
from params, and URIs are logged with any user:password part removed.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from mlflow.entities import Metric, Param, RunTag

from longlive_core.tracking.lineage import git_state

log = logging.getLogger(__name__)
T = TypeVar("T")
# set by the Prefect flow for the stages it runs: their runs nest under the pipeline run
PARENT_RUN_ENV = "LONGLIVE_MLFLOW_PARENT_RUN_ID"


@dataclasses.dataclass(frozen=True)
class TrackingConfig:
    enabled: bool = True
    tracking_uri: str = "sqlite:///mlflow.db"
    experiment: str = "longlive-pipeline"
    artifact_root: str = "mlartifacts"  # for a local store: where run artifacts go
    timeout_s: float = 10.0  # for a remote store: how long to wait before giving up on it
    system_metrics_s: float = 0.0  # CPU, memory, disk, network (and GPU with pynvml) every N s; 0: off


def redact_uri(uri: str) -> str:
    return re.sub(r"//[^/@]*@", "//***@", uri)


def resolve_store_uri(uri: str, repo_root: Path) -> str:
    """A relative SQLite or plain-path store is relative to the repository, not to the caller's cwd."""
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return "sqlite:///" + str((repo_root / uri[len("sqlite:///"):]).resolve())
    if "://" not in uri and not uri.startswith("databricks"):
        return str((repo_root / uri).resolve())
    return uri


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


IDENTITY_TAG = "model.identity"  # a registered version's model identity (reports/merge_w4a4/identity.json's digest)


class RegistryError(RuntimeError):
    """The model registry could not be read: whether a champion exists is unknown."""


@dataclasses.dataclass(frozen=True)
class RegisteredVersion:
    version: str
    run_id: str
    source: str  # where its artifacts are (runs:/<run>/bundle)
    metrics: dict[str, float]  # of the run it was registered from
    tags: dict[str, str]


class StageRun:
    """Context manager around ``mlflow.start_run`` for one DVC stage."""

    def __init__(self, cfg: TrackingConfig, stage: str, repo_root: str | Path = ".",
                 run_name: str | None = None, resume_run_id: str | None = None):
        self.cfg, self.stage = cfg, stage
        self.resume_run_id = resume_run_id  # log into this existing run instead of starting one
        self.repo_root = Path(repo_root)
        self.run_name = run_name or stage
        self.uri = resolve_store_uri(os.environ.get("MLFLOW_TRACKING_URI") or cfg.tracking_uri, self.repo_root)
        self.active = cfg.enabled
        self.run_id: str | None = None
        self._client: Any = None
        self._monitor: Any = None
        if not cfg.enabled:
            log.info("MLflow tracking is off (tracking.enabled: false)")

    # -- plumbing -------------------------------------------------------------------------
    def _safe(self, what: str, fn: Callable[[], T]) -> T | None:
        if not self.active:
            return None
        try:
            return fn()
        except Exception as exc:  # any tracking failure must leave the stage running
            self.active = False
            log.warning("MLflow tracking failed while %s (%s: %s); the stage goes on untracked. Store: %s",
                        what, type(exc).__name__, str(exc).splitlines()[0][:300] if str(exc) else "",
                        redact_uri(self.uri))
            return None

    def _check_remote(self) -> None:
        if self.uri.startswith(("http://", "https://")):
            health = self.uri.rstrip("/") + "/health"
            with urllib.request.urlopen(health, timeout=self.cfg.timeout_s) as resp:  # noqa: S310
                if resp.status != 200:
                    raise ConnectionError(f"health check answered HTTP {resp.status}")
            # fail fast if the server goes away mid-run instead of retrying for minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(int(self.cfg.timeout_s)))

    def _start(self) -> str:
        self._check_remote()
        # A client bound to this store, not mlflow's process-wide fluent state: a process that
        # runs several stages (the Prefect flow, the tests) must not leak one run's store or
        # active run into the next.
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.uri)
        if self.resume_run_id:
            self._client.get_run(self.resume_run_id)  # fails here, not later, if the store lost it
            return self.resume_run_id
        exp = self._client.get_experiment_by_name(self.cfg.experiment)
        if exp is None:
            artifact_location = None
            if "://" not in self.uri or self.uri.startswith(("sqlite:", "file:")):
                artifact_location = (self.repo_root / self.cfg.artifact_root).resolve().as_uri()
            exp_id = self._client.create_experiment(self.cfg.experiment, artifact_location=artifact_location)
        else:
            exp_id = exp.experiment_id
        parent = os.environ.get(PARENT_RUN_ENV)
        tags = {"mlflow.parentRunId": parent} if parent else None
        return self._client.create_run(exp_id, run_name=self.run_name, tags=tags).info.run_id

    # -- API --------------------------------------------------------------------------------
    def _start_system_metrics(self) -> None:
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

        self._monitor = SystemMetricsMonitor(self.run_id, sampling_interval=self.cfg.system_metrics_s,
                                             tracking_uri=self.uri)
        self._monitor.start()

    def __enter__(self) -> StageRun:
        self.run_id = self._safe("starting the run", self._start)
        if self.run_id and self.cfg.system_metrics_s > 0 and not self.resume_run_id:
            self._safe("starting system metrics", self._start_system_metrics)
        slurm = {"slurm.job_id": os.environ["SLURM_JOB_ID"]} if os.environ.get("SLURM_JOB_ID") else {}
        self.set_tags({"dvc.stage": self.stage, **git_state(self.repo_root), **slurm})
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        status = "FAILED" if exc_type else "FINISHED"
        if self._monitor is not None:
            self._safe("stopping system metrics", self._monitor.finish)
        if exc_type:
            self.set_tags({"error": f"{exc_type.__name__}: {exc}"[:500]})
        self._safe("ending the run", lambda: self._client.set_terminated(self.run_id, status=status))

    def log_params(self, params: Mapping[str, Any]) -> None:
        flat = {k: redact_uri("" if v is None else str(v))[:6000] for k, v in flatten(params).items()}
        items = sorted(flat.items())
        for i in range(0, len(items), 100):
            batch = dict(items[i:i + 100])
            params_ = [Param(k, v) for k, v in batch.items()]
            self._safe("logging params", lambda p=params_: self._client.log_batch(self.run_id, params=p))

    def log_metrics(self, metrics: Mapping[str, float | int], step: int | None = None) -> None:
        # MLflow allows few characters in names ("bucket_>64s" is refused): replace the others
        clean = {re.sub(r"[^\w\-. :/]", "_", k): float(v) for k, v in metrics.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)}
        now = int(time.time() * 1000)
        metrics_ = [Metric(k, v, now, step or 0) for k, v in clean.items()]
        self._safe("logging metrics", lambda: self._client.log_batch(self.run_id, metrics=metrics_))

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        tags_ = [RunTag(k, str(v)) for k, v in tags.items()]
        self._safe("setting tags", lambda: self._client.log_batch(self.run_id, tags=tags_))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        if not Path(path).exists():
            log.warning("not logging artifact %s: it does not exist", path)
            return
        many = Path(path).is_dir()
        self._safe(f"logging artifact {path}", lambda: (self._client.log_artifacts if many else
                                                        self._client.log_artifact)(self.run_id, str(path),
                                                                                   artifact_path))

    def registered_alias(self, name: str, alias: str) -> RegisteredVersion | None:
        """Registered model ``name``'s ``alias``: its version, and the metrics and tags of the run it
        was registered from; None when the model or the alias does not exist. Raises RegistryError
        when the registry cannot be read (tracking off, unreachable, an error): an absent champion
        and an unknown one are not the same answer."""
        from mlflow.exceptions import MlflowException

        if not self.active:
            raise RegistryError("MLflow tracking is off (tracking.enabled: false)" if not self.cfg.enabled else
                                f"MLflow tracking failed earlier in this stage (store {redact_uri(self.uri)})")
        try:
            try:
                version = self._client.get_model_version_by_alias(name, alias)
            except MlflowException as exc:
                if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
                    return None
                raise
            data = self._client.get_run(version.run_id).data
            return RegisteredVersion(str(version.version), version.run_id, version.source, dict(data.metrics),
                                     dict(data.tags))
        except Exception as exc:  # any failure to read is an unknown champion, never "none"
            first = str(exc).splitlines()[0][:300] if str(exc) else ""
            raise RegistryError(f"{type(exc).__name__}: {first} (store {redact_uri(self.uri)})") from None

    def download(self, artifact_uri: str, directory: str | Path) -> Path:
        """A registered version's artifacts (``runs:/<run>/bundle``, as ``register`` records them)."""
        import mlflow.artifacts

        return Path(mlflow.artifacts.download_artifacts(artifact_uri=artifact_uri, dst_path=str(directory),
                                                        tracking_uri=self.uri))

    def register(self, name: str, directory: str | Path, aliases: list[str], tags: Mapping[str, str],
                 identity: str) -> str | None:
        """Registers the bundle ``directory`` as a version of ``name`` (created if new) with ``aliases``
        moved to it; the version, or None untracked. The same model (``identity``: the weights and how
        they run) is one version: registered again, its version gets the aliases, nothing new."""
        from mlflow.exceptions import MlflowException

        def same_model() -> str | None:
            for v in self._client.search_model_versions(f"name='{name}'"):
                if v.tags.get(IDENTITY_TAG) == identity:
                    return str(v.version)
            return None

        known = self._safe("reading the model registry", same_model)
        if known is None and self.active:
            self.log_artifact(directory, "bundle")

        def register_version() -> str:
            if known is not None:
                for alias in aliases:
                    self._client.set_registered_model_alias(name, alias, known)
                return known
            try:
                self._client.create_registered_model(name)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise
            source = self._client.get_run(self.run_id).info.artifact_uri.rstrip("/") + "/bundle"
            version = self._client.create_model_version(name, source, run_id=self.run_id,
                                                        tags={**tags, IDENTITY_TAG: identity})
            for alias in aliases:
                self._client.set_registered_model_alias(name, alias, version.version)
            return str(version.version)

        return self._safe("registering the model", register_version)
