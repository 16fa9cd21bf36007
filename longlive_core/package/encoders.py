"""The encoders in a model bundle: ``package.include_encoders`` copies the VAE and the text encoder
into ``encoders/vae/`` and ``encoders/text_encoder/`` and points the bundled ``model/config.json`` at
them (``../encoders/<role>``, relative to ``model/``); ``longlive bundle verify`` checks them against
the digests that config records. A bundle without them names the training repository's paths, and
``longlive generate`` checks whatever it finds there against the same digests.
"""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path, PurePosixPath

from longlive_core.models.encoders import LABELS, ROLES, TINY, USER, Memo, check_encoder, resolve_encoder_path
from longlive_core.models.folder import DiTFolder, read_dit_folder
from longlive_core.models.weights import CheckpointError
from longlive_core.package.bundle import BundleError

MODEL = "model"  # the bundle's model folder
ENCODERS = "encoders"  # the bundle's encoders, one folder per role


def bundled_path(role: str, name: str | None = None) -> str:
    """The path ``model/config.json`` gives a bundled encoder (a single-file encoder keeps its file
    name: the weights' identity covers the names)."""
    return str(PurePosixPath("..", ENCODERS, role, *([name] if name else [])))


def bundle_encoders(folder: DiTFolder, folder_dir: Path, bundle: Path, memo_path: Memo = USER) -> DiTFolder:
    """Copies each encoder ``folder`` names (the model folder at ``folder_dir``) into
    ``bundle``/encoders/<role>/ once it matches the digest the folder records, and returns ``folder``
    with the bundled paths (and where they came from in its lineage). ``tiny`` encoders stay as they
    are; an encoder with no recorded digest is refused: the bundle would promise what nobody checked."""
    changes, origins = {}, {}
    for role in ROLES:
        encoder = getattr(folder, role)
        if encoder.path == TINY:
            continue
        if encoder.sha256 is None:
            raise CheckpointError(f"{folder_dir / 'config.json'} records no digest for its {LABELS[role]} (a model "
                                  "made before digests were kept): rerun train_ar and the stages after it, or set "
                                  "package.include_encoders: false")
        source = Path(check_encoder(role, encoder, folder_dir, memo_path))
        target = bundle / ENCODERS / role
        if source.is_dir():
            shutil.copytree(source, target)
            path = bundled_path(role)
        else:
            target.mkdir(parents=True)
            shutil.copyfile(source, target / source.name)
            path = bundled_path(role, source.name)
        changes[role], origins[role] = dataclasses.replace(encoder, path=path), encoder.path
    if not changes:
        return folder
    return dataclasses.replace(folder, **changes, lineage={**folder.lineage, "bundled_encoders_from": origins})


def _in_bundle(path: str) -> bool:
    """Whether a model/config.json path is one ``bundle_encoders`` wrote (a training repository's
    relative path is looked up beside model/ too, but is not the bundle's)."""
    return PurePosixPath(path).parts[:2] == ("..", ENCODERS)


def verify_bundle_encoders(root: Path, memo_path: Memo = USER) -> str:
    """One line on the encoders of the bundle ``root`` (already verified against SHA256SUMS): the
    bundled ones checked against the digests ``model/config.json`` records (a BundleError naming the
    encoder when one differs), or what ``longlive generate`` will look for when none is bundled."""
    model_dir = root / MODEL
    try:
        folder = read_dit_folder(model_dir, "package")
    except CheckpointError as exc:
        raise BundleError(f"{root}: {exc}") from None
    bundled = [role for role in ROLES if _in_bundle(getattr(folder, role).path)]
    for role in bundled:
        try:
            check_encoder(role, getattr(folder, role), model_dir, memo_path)
        except CheckpointError as exc:
            raise BundleError(f"{root}: {exc}") from None
    if bundled:
        return " and ".join(f"{LABELS[r]} ({getattr(folder, r).path.removeprefix('../')})" for r in bundled) + \
            " match the digests in model/config.json"
    outside = [role for role in ROLES if getattr(folder, role).path != TINY]
    if not outside:
        return "its encoders are the built-in tiny ones (no weights)"
    where = "; ".join(f"the {LABELS[r]} from {resolve_encoder_path(getattr(folder, r).path, model_dir)}"
                      for r in outside)
    return (f"the bundle holds no encoders (package.include_encoders was false): `longlive generate` loads {where} "
            "and checks each against the digest in model/config.json")


def encoder_lines(folder: DiTFolder) -> list[str]:
    """The model card's lines on each encoder: in the bundle, built in, or where to put it."""
    lines = []
    for role in ROLES:
        encoder, label = getattr(folder, role), LABELS[role]
        if encoder.path == TINY:
            lines.append(f"- {label}: the built-in tiny random model (seed {encoder.seed}); nothing to put anywhere")
        elif _in_bundle(encoder.path):
            lines.append(f"- {label}: `{encoder.path.removeprefix('../')}/` in this bundle (weights identity "
                         f"`{encoder.sha256}`)")
        else:
            lines.append(f"- {label}: not in this bundle: put it at `{encoder.path}` (beside `model/` or from where "
                         f"`longlive generate` runs); it must have weights identity `{encoder.sha256}`")
    return lines
