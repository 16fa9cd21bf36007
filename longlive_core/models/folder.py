"""The model-folder contract (MISSION.md "Model folders") as typed objects: read, checked and written
here alone.

``train_ar`` writes ``models/ar/`` (a ``longlive-dit`` folder), ``merge_w4a4`` ``models/w4a4/`` (a
``longlive-w4a4`` one: the same fields, the weights packed, plus compressed-tensors'
``quantization_config``), ``distill_dmd`` ``models/dmd/`` (a ``peft-lora`` adapter for the AR
model). Every ``config.json`` carries ``schema_version``; a folder of an older version is read through
``_MIGRATIONS`` (the champion's folder and published bundles stay readable), a newer one is refused.
A missing or malformed field is a ``CheckpointError`` naming the file and the field.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from longlive_core.config import ConfigError, from_mapping
from longlive_core.io.atomic import write_json
from longlive_core.models.config import DiTConfig, dit_config
from longlive_core.models.weights import CheckpointError

CONFIG = "config.json"  # beside the weights: what rebuilds and runs the model
SCHEMA_VERSION = 3  # 1: before config.json carried its version (no encoder digests, no base identity);
# 2: sampling.window counted the cached frames only, not the chunk itself, and rollouts had no sinks
DIT_FORMATS = ("longlive-dit", "longlive-w4a4")
ADAPTER_FORMAT = "peft-lora"


@dataclasses.dataclass(frozen=True)
class LatentGeometry:
    channels: int
    chunk_frames: int  # latent frames per chunk (num_frame_per_block)
    height: int
    width: int
    temporal_stride: int = 4
    spatial_stride: int = 16


@dataclasses.dataclass(frozen=True)
class VideoFormat:
    fps: float
    height: int
    width: int


@dataclasses.dataclass(frozen=True)
class Encoder:
    """The VAE or the text encoder the latents and captions were made with: a local path, or ``tiny``
    with its seed; ``sha256``: the weights' identity (None in folders written before it was kept)."""

    path: str
    sha256: str | None = None
    seed: int | None = None
    max_length: int | None = None  # the text encoder's token count


@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling the weights were made for: the default of whatever runs them."""

    kind: str  # flow-matching (the AR model: its full schedule) | few-step (distilled)
    steps: tuple[int, ...] | None = None  # the denoising steps, descending to 0; None: the full schedule
    num_train_timesteps: int | None = None
    timestep_shift: float | None = None
    window: int | None = None  # latent frames a chunk attends to, itself and the sinks included; None: all before
    chunk_frames: int | None = None
    global_sink: int | None = None  # the video's first latent frames kept in the KV cache (None: not recorded)
    shot_sink: int | None = None  # the current shot's first latent frames kept in it


@dataclasses.dataclass(frozen=True)
class MultiShot:
    shot_rope_offset: int
    scene_transition_prefix: bool = True


@dataclasses.dataclass(frozen=True)
class PrecisionRules:
    recipe: str
    skip: tuple[str, ...]
    keep_last_blocks: int = 0


@dataclasses.dataclass(frozen=True)
class DiTFolder:
    """``config.json`` of a ``longlive-dit`` or ``longlive-w4a4`` folder."""

    format: str
    stage: str
    dit: dict[str, Any]  # "name" (models/config.py) and the dims it had when written
    latent: LatentGeometry
    video: VideoFormat
    vae: Encoder
    text_encoder: Encoder
    sampling: Sampling
    multi_shot: MultiShot
    precision: PrecisionRules
    weights_dtype: str = "bfloat16"
    lineage: dict[str, Any] = dataclasses.field(default_factory=dict)  # where it came from: never its identity
    quantization_config: dict[str, Any] | None = None  # compressed-tensors' (longlive-w4a4)
    longlive_quantization: dict[str, Any] | None = None  # what that schema cannot say (weight tiles, 4/6)
    schema_version: int = SCHEMA_VERSION

    def validate(self, where: str) -> None:
        if self.format not in DIT_FORMATS:
            raise ConfigError(f"{where}.format must be one of {', '.join(DIT_FORMATS)}; got {self.format!r}")
        if not isinstance(self.dit.get("name"), str):
            raise ConfigError(f"{where}.dit.name is missing: the DiT config's name (models/config.py)")
        dit = dit_config(self.dit["name"])
        if self.latent.channels != dit.in_channels:
            raise ConfigError(f"{where}.latent.channels is {self.latent.channels} but DiT {self.dit['name']} reads "
                              f"{dit.in_channels}: the folder's latents and its model do not fit together")
        if self.format == "longlive-w4a4" and (self.quantization_config is None or self.longlive_quantization is None):
            raise ConfigError(f"{where}: a longlive-w4a4 folder needs quantization_config and longlive_quantization")

    @property
    def dit_config(self) -> DiTConfig:
        try:
            return dit_config(self.dit["name"])
        except ConfigError as exc:
            raise CheckpointError(f"config.json's dit.name: {exc}") from None


@dataclasses.dataclass(frozen=True)
class AdapterSettings:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple[str, ...] = ()
    name: str = "default"


@dataclasses.dataclass(frozen=True)
class AdapterFolder:
    """``config.json`` of a ``peft-lora`` folder: the distilled generator's adapter for the AR model."""

    format: str
    stage: str
    base_model: str  # the AR model folder it was distilled on
    adapter: AdapterSettings
    sampling: Sampling
    distillation: dict[str, Any]
    base_model_identity: str | None = None  # the AR folder's identity digest (None before it was kept)
    lineage: dict[str, Any] = dataclasses.field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION

    def validate(self, where: str) -> None:
        if self.format != ADAPTER_FORMAT:
            raise ConfigError(f"{where}.format must be {ADAPTER_FORMAT}; got {self.format!r}")


def _v1_to_v2(raw: dict[str, Any]) -> dict[str, Any]:
    """Version 1 (no schema_version): the same fields, fewer of them; the new ones are optional."""
    return {**raw, "schema_version": 2}


def _v2_to_v3(raw: dict[str, Any]) -> dict[str, Any]:
    """Version 2's window was the frames cached besides the chunk, and its rollouts had no sinks: the
    same attention in version 3's terms is that window plus the chunk, with sinks of 0."""
    sampling = raw.get("sampling")
    if isinstance(sampling, dict) and sampling.get("kind") == "few-step":
        sampling = {"global_sink": 0, "shot_sink": 0, **sampling}
        if isinstance(sampling.get("window"), int) and isinstance(sampling.get("chunk_frames"), int):
            sampling["window"] += sampling["chunk_frames"]
        raw = {**raw, "sampling": sampling}
    return {**raw, "schema_version": 3}


_MIGRATIONS = {1: _v1_to_v2, 2: _v2_to_v3}  # version -> the function that makes it the next one


def read_folder(directory: str | Path, made_by: str | None = None) -> DiTFolder | AdapterFolder:
    """The typed config.json of a model folder; ``made_by`` names the stage that writes it, for the
    message when it is missing (None: a folder a user named, which any of them may have written)."""
    path = Path(directory) / CONFIG
    remake = f"rerun {made_by}" if made_by else "make it again"
    if not path.is_file():
        if made_by:
            raise CheckpointError(f"{path} is missing: run {made_by} first (dvc repro {made_by})")
        raise CheckpointError(f"{path} is missing: {directory} is not a model folder (train_ar, distill_dmd and "
                              "merge_w4a4 write them, package bundles them); give the folder that holds config.json")
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc}): the folder is damaged; {remake}, or "
                              "copy the folder again") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} must hold a JSON object")
    version = raw.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise CheckpointError(f"{path} has schema_version {version!r}, newer than this code reads "
                              f"({SCHEMA_VERSION}): update the pipeline to read it")
    while version < SCHEMA_VERSION:
        raw, version = _MIGRATIONS[version](raw), version + 1
    if raw.get("format") not in (*DIT_FORMATS, ADAPTER_FORMAT):
        raise CheckpointError(f"{path} has format {raw.get('format')!r}: not a model folder this project runs "
                              f"({', '.join((*DIT_FORMATS, ADAPTER_FORMAT))})")
    cls = AdapterFolder if raw["format"] == ADAPTER_FORMAT else DiTFolder
    try:
        return from_mapping(cls, raw, "config")
    except ConfigError as exc:  # "config.<field>...": the field, in the file named first
        raise CheckpointError(f"{path}: {exc}; the folder is damaged or not a model folder: {remake}, or "
                              "copy the folder again") from None


def read_dit_folder(directory: str | Path, made_by: str | None = None) -> DiTFolder:
    folder = read_folder(directory, made_by)
    if not isinstance(folder, DiTFolder):
        raise CheckpointError(f"{Path(directory) / CONFIG} is a {folder.format} folder (an adapter), not a model "
                              "this project runs (longlive-dit, longlive-w4a4)")
    return folder


def read_adapter_folder(directory: str | Path, made_by: str = "distill_dmd") -> AdapterFolder:
    folder = read_folder(directory, made_by)
    if not isinstance(folder, AdapterFolder):
        raise CheckpointError(f"{Path(directory) / CONFIG} is a {folder.format} folder, not a {ADAPTER_FORMAT} "
                              "adapter")
    return folder


def as_json(folder: DiTFolder | AdapterFolder) -> dict[str, Any]:
    """The JSON object written as config.json (what ``read_folder`` reads back)."""
    return json.loads(json.dumps(dataclasses.asdict(folder)))


def write_config(folder: DiTFolder | AdapterFolder, directory: str | Path) -> dict[str, Any]:
    """Writes ``directory``/config.json; returns what it wrote."""
    data = as_json(folder)
    write_json(data, Path(directory) / CONFIG)
    return data
