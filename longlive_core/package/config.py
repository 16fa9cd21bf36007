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
    # copy the VAE and the text encoder into the bundle (encoders/), checked against the model's digests, so a
    # deployer needs nothing else; false: the bundle names the training repository's paths and their digests
    include_encoders: bool = False

    def validate(self, where: str) -> None:
        if self.s3_uri is not None:
            try:
                split_s3(self.s3_uri, f"{where}.s3_uri")
            except BundleError as e:
                raise ConfigError(str(e)) from None


def promotion(scores: dict, identity: str, champion_now: str | None, registry_failure: str | None = None
              ) -> tuple[list[str], str]:
    """(the aliases the bundle gets, why): ``candidate`` always; ``champion`` only for the model the
    verdict judged (``identity``: the bundled model's, against the one evaluate scored), when it
    passed, and when the champion it was compared with (``champion_now``: the registry's champion
    version now, None for none) is still the champion."""
    verdict = scores["verdict"]
    judged, against = scores.get("candidate_identity"), verdict.get("champion_version")
    if not verdict["passed"]:
        return ["candidate"], "the verdict failed: the champion stays"
    if judged != identity:
        return ["candidate"], (f"the verdict judged another model (identity {judged}, this one is {identity}): rerun "
                               "evaluate; the champion stays")
    if registry_failure is not None:
        return ["candidate"], f"the registry could not be read to check the champion ({registry_failure}): not promoted"
    if champion_now != against:
        return ["candidate"], (f"the champion changed since the verdict (compared with "
                               f"{'none' if against is None else 'version ' + against}, now "
                               f"{'none' if champion_now is None else 'version ' + champion_now}): rerun evaluate; "
                               "not promoted")
    return ["candidate", "champion"], ("the verdict passed against no champion" if against is None else
                                       f"the verdict passed against version {against}, still the champion")
