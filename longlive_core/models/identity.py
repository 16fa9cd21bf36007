"""A model folder's identity: its weights and what changes how they run, never its lineage.

``train_ar``, ``distill_dmd`` and ``merge_w4a4`` each write ``reports/<stage>/identity.json`` beside
their model folder: the SHA-256 of every weight file and every field of the folder's config.json
except its lineage (architecture, latent geometry, sampling, precision, the encoders' identities).
Downstream stages depend on that file in dvc.yaml and key their own digests on it, so a rerun that
exports bit-identical weights (a resumed run with nothing left to train, a new commit that changed no
number) writes the same identity and nothing after it reruns; config.json keeps the lineage for
people and MLflow (MISSION.md "Model folders").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from longlive_core.io.atomic import write_json
from longlive_core.models.weights import CheckpointError
from longlive_core.tracking.lineage import digest_file, digest_json, digest_lines

IDENTITY = "identity.json"
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
NOT_IDENTITY = ("lineage",)  # config.json's fields that describe where the weights came from, not what they are


def weights_sha256(directory: str | Path) -> str:
    """A digest of the folder's weight files: each name with the SHA-256 of its bytes."""
    directory = Path(directory)
    files = sorted({p for pattern in WEIGHT_PATTERNS for p in directory.glob(pattern) if p.is_file()})
    if not files:
        raise CheckpointError(f"{directory} holds no safetensors weights")
    return digest_lines(f"{p.name}\t{digest_file(p)}" for p in files)


def folder_identity(directory: str | Path, config: dict[str, Any]) -> dict[str, Any]:
    """The identity of the model folder ``directory`` whose config.json is ``config``."""
    return {"weights_sha256": weights_sha256(directory),
            "config": {k: v for k, v in config.items() if k not in NOT_IDENTITY}}


def write_identity(directory: str | Path, config: dict[str, Any], target: str | Path) -> dict[str, Any]:
    """Writes ``target`` (the same bytes for the same weights and config: DVC then reruns nothing)."""
    identity = folder_identity(directory, config)
    write_json(identity, target)
    return identity


def identity_digest(path: str | Path) -> str:
    """A short digest of an identity file, for a downstream stage's run digest and lineage."""
    path = Path(path)
    try:
        identity = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: rerun the stage that writes it") from None
    except ValueError as exc:
        raise CheckpointError(f"{path} is not JSON ({exc}): rerun the stage that writes it") from None
    return digest_json(identity)[:16]
