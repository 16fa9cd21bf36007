"""The typed configuration of ``package`` (``params.yaml``'s ``package`` section)."""
from __future__ import annotations

import dataclasses

from longlive_core.config import ConfigError
from longlive_core.data.s3_mirror import S3Config
from longlive_core.package.bundle import BundleError, split_s3


@dataclasses.dataclass(frozen=True)
class PackageConfig:
    s3_uri: str | None = None  # s3://bucket/prefix: each version is published under prefix/<version>/; null: none
    s3: S3Config = S3Config()  # endpoint, region, profile, retries; credentials only from the environment
    register: bool = True  # register the bundle in the MLflow model registry (alias candidate; champion on a pass)

    def validate(self, where: str) -> None:
        if self.s3_uri is not None:
            try:
                split_s3(self.s3_uri, f"{where}.s3_uri")
            except BundleError as e:
                raise ConfigError(str(e)) from None


def registry_aliases(verdict: dict) -> list[str]:
    """``candidate`` always moves to the new version; ``champion`` only when the verdict passed."""
    return ["candidate", "champion"] if verdict["passed"] else ["candidate"]
