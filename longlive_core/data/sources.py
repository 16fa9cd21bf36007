"""Where raw videos come from: a local directory (walked recursively) or ``s3://bucket/prefix``
(mirrored locally first: ``s3_mirror``).

Both give the same listing: every file under the root with a POSIX path relative to it, a local
path to read it from and a cheap fingerprint (mtime and size locally, ETag and size on S3) that
tells the ingest stage whether a file changed since its last run.

Nothing outside the root is followed: symlinks whose target leaves the root are listed with a
problem (so they get quarantined, not dropped), and symlinked and hidden directories are not
descended into.
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from longlive_core.data.listing import Listing, SourceFile
from longlive_core.data.roots import SourceError

if TYPE_CHECKING:
    from longlive_core.data.s3_mirror import S3Config, S3Source

log = logging.getLogger(__name__)


# What any S3 store's bucket names are made of (AWS's older buckets and other stores also allow
# capitals and underscores, so no more is checked here: the store answers for the rest).
_BUCKET_NAME = re.compile(r"[A-Za-z0-9._-]{1,255}")


def check_source_uri(uri: str) -> None:
    """Raises SourceError, with what to write instead, if ``uri`` is neither a local path nor a
    well-formed ``s3://bucket/prefix``. Whether the directory or bucket exists is not checked."""
    if not uri or not uri.strip():
        raise SourceError("ingest.source is empty: set it in params.yaml to a local directory or an "
                          "s3://bucket/prefix URI")
    scheme, sep, rest = uri.partition("://")
    if not sep:
        if uri.lower().startswith("s3:"):
            raise SourceError(f"ingest.source {uri!r} is not a valid S3 URI: write s3://bucket/prefix")
        return
    if scheme != "s3":
        hint = " (write the scheme in lowercase: s3://)" if scheme.lower() == "s3" else ""
        raise SourceError(f"ingest.source {uri!r}: {scheme}:// sources are not supported{hint}; only local "
                          "directories and s3://bucket/prefix are")
    bucket = rest.partition("/")[0]
    if not bucket:
        raise SourceError(f"ingest.source {uri!r} names no bucket: write s3://bucket/prefix")
    if not _BUCKET_NAME.fullmatch(bucket) or ".." in bucket:
        raise SourceError(f"ingest.source {uri!r}: {bucket!r} is not an S3 bucket name (letters, digits, dots, "
                          "hyphens and underscores); fix the bucket name")


class LocalSource:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = str(root)

    @property
    def local_root(self) -> Path:
        return self.root

    def check_root(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise SourceError(
                f"ingest.source {self.root} is a file, not a directory: set ingest.source in params.yaml to "
                "the directory that holds the raw videos, or to an s3://bucket/prefix URI")
        if not self.root.is_dir():
            raise SourceError(
                f"ingest.source {self.root} is not a directory: put the raw videos there, or set "
                "ingest.source in params.yaml to a directory or an s3://bucket/prefix URI")

    def list(self) -> Listing:
        self.check_root()
        real_root = self.root.resolve()
        files: list[SourceFile] = []
        skipped = 0
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            for d in list(dirnames):
                if os.path.islink(os.path.join(dirpath, d)):
                    skipped += 1
            # hidden folders (.git, .cache, a mirror's own) hold no videos, and their files have no extension
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in sorted(filenames):
                full = Path(dirpath) / name
                rel = full.relative_to(self.root).as_posix()
                if full.is_symlink():
                    target = full.resolve()
                    if not target.is_relative_to(real_root):
                        files.append(SourceFile(rel, None, 0, "link", "symlink points outside the source root"))
                        continue
                    if not target.is_file():
                        files.append(SourceFile(rel, None, 0, "link", "broken symlink"))
                        continue
                try:
                    st = full.stat()
                except OSError as exc:
                    files.append(SourceFile(rel, None, 0, "unstattable", f"unreadable: {exc.strerror}"))
                    continue
                files.append(SourceFile(rel, full, st.st_size, f"{st.st_mtime_ns}:{st.st_size}"))
        if skipped:
            log.warning("did not descend into %d symlinked director%s under %s", skipped,
                        "y" if skipped == 1 else "ies", self.root)
        return Listing(files=sorted(files, key=lambda f: f.relpath), skipped_dir_links=skipped)


def check_source(uri: str) -> None:
    """Everything about ingest.source that is known without listing it: the URI's form, and that a
    local source is a directory (whether a bucket answers shows only when it is listed)."""
    check_source_uri(uri)
    if not uri.startswith("s3://"):
        LocalSource(uri).check_root()


def open_source(uri: str, cache_dir: str | Path, s3: S3Config) -> LocalSource | S3Source:
    check_source_uri(uri)
    if uri.startswith("s3://"):
        from longlive_core.data.s3_mirror import S3Source  # it imports this module (the URI check)

        return S3Source(uri, cache_dir, s3)
    return LocalSource(uri)
