"""The VAE and the text encoder a model folder names: where they are, and whether they are the ones
the model was made with.

A folder's ``config.json`` names each encoder by a path and records its identity
(``weights_identity`` of that path when ``train_ar`` wrote the folder; ``merge_w4a4`` carries it
over). A relative path is looked up beside the folder first (a bundle's ``model/config.json`` names
``../encoders/vae``), then from the current directory (a folder in the training repository names
params.yaml's paths, relative to the repository's root).

Whoever runs a folder away from the training repository (``longlive generate``, ``longlive bundle
verify``) memoises the encoders' digests in the user's cache directory, not in ``data/`` of the
current directory: an 11 GB umT5 is read once per machine, and no ``data/`` appears in a user's folder.
"""
from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Literal

from longlive_core.models.folder import DiTFolder, Encoder
from longlive_core.models.weights import CheckpointError, weights_identity

log = logging.getLogger(__name__)
ROLES = ("vae", "text_encoder")  # DiTFolder's encoder fields
LABELS = {"vae": "VAE", "text_encoder": "text encoder (umT5)"}
TINY = "tiny"  # the built-in random encoders: no weights, nothing to check
USER = "user"  # memo_path's default: the user's cache memo (user_memo); None: no memo, as weights_identity
Memo = Path | None | Literal["user"]


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/longlive``, or ``~/.cache/longlive`` (the XDG default; a relative
    ``XDG_CACHE_HOME`` is invalid by the spec and ignored)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "longlive"


def user_memo() -> Path:
    """The weights-digest memo of a user's runs (a cache only: deleting it costs one more read)."""
    return user_cache_dir() / "weights_sha256.json"


def resolve_encoder_path(path: str, folder_dir: str | Path | None) -> str:
    """The path to load an encoder from: ``tiny`` and absolute paths as they are; a relative one
    beside the folder when something is there, else as given (from the current directory)."""
    if path == TINY or os.path.isabs(path) or folder_dir is None:
        return path
    beside = Path(folder_dir) / path
    return str(beside) if beside.exists() else path


def _has_weights(path: Path) -> bool:
    return path.is_file() or (path.is_dir() and any(p.is_file() for p in path.rglob("*")))


def _writable_memo(memo_path: Path) -> Path | None:
    """``memo_path``, or None where this user cannot write its folder (a read-only home): a re-read of
    the weights then, never a failed run."""
    with contextlib.suppress(OSError):  # os.access below says whether it can be written
        memo_path.parent.mkdir(parents=True, exist_ok=True)
    if os.access(memo_path.parent, os.W_OK):
        return memo_path
    log.warning("cannot write the weights-digest memo in %s: the encoders are read whole on every run",
                memo_path.parent)
    return None


def _identity(path: str, memo_path: Path | None) -> str:
    try:
        return weights_identity(path, memo_path)
    except PermissionError as exc:
        raise CheckpointError(f"cannot read {exc.filename or path}: give this user read access to the "
                              "encoder's weights") from None


def check_encoder(role: str, encoder: Encoder, folder_dir: str | Path | None, memo_path: Memo = USER) -> str:
    """The path to load ``role``'s encoder from, once its weights match the digest the folder
    records; a CheckpointError of one line otherwise. Not checked, and said in the log: ``tiny``
    (built in) and an encoder whose ``sha256`` is None (a folder written before digests were kept).
    ``memo_path``: ``"user"`` the user's cache memo, None no memo, or a memo file."""
    where = str(Path(folder_dir) / "config.json") if folder_dir is not None else "the model config"
    label, resolved = LABELS[role], resolve_encoder_path(encoder.path, folder_dir)
    if resolved == TINY:
        return resolved
    if encoder.sha256 is None:
        log.warning("%s records no digest for its %s (a folder made before digests were kept): %s is not checked",
                    where, label, resolved)
        return resolved
    if not _has_weights(Path(resolved)):
        raise CheckpointError(f"{where} names the {label} {encoder.path!r}, which is not there ({resolved}): put "
                              f"the {label} the model was made with there (weights identity {encoder.sha256}), or "
                              "use a bundle made with package.include_encoders: true")
    found = _identity(resolved, _writable_memo(user_memo()) if memo_path == USER else memo_path)
    if found != encoder.sha256:
        raise CheckpointError(f"the {label} at {resolved} has weights identity {found}, but {where} records "
                              f"{encoder.sha256}: it is not the {label} the model was made with; put that one "
                              f"there (or point {role}.path of {where} at it)")
    return resolved


def check_encoders(folder: DiTFolder, folder_dir: str | Path | None = None, memo_path: Memo = USER
                   ) -> dict[str, str]:
    """``{"vae": path, "text_encoder": path}``: where to load each encoder from (``resolve_encoder_path``),
    each checked against the digest ``folder`` records (``check_encoder``; ``tiny`` encoders and
    unrecorded digests are skipped). ``folder_dir``: the folder's directory, for relative paths;
    ``memo_path``: the digest memo (``"user"``: the user's cache, ``user_memo``; None: none)."""
    return {role: check_encoder(role, getattr(folder, role), folder_dir, memo_path) for role in ROLES}
