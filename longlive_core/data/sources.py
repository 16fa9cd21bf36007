"""Where raw videos come from: a local directory (walked recursively) or ``s3://bucket/prefix``.

Both give the same listing: every file under the root with a POSIX path relative to it, a local
path to read it from and a cheap fingerprint (mtime and size locally, ETag and size on S3) that
tells the ingest stage whether a file changed since its last run. An S3 source first syncs the
objects into a local cache directory, downloading only new or changed ones.

Nothing outside the root is followed: symlinks whose target leaves the root are listed with a
problem (so they get quarantined, not dropped), symlinked directories are not descended into, and
object keys that would escape the cache directory are refused.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import time
from pathlib import Path, PurePosixPath
from typing import Any

from longlive_core.io.atomic import atomic_path, write_json
from longlive_core.progress import Progress

log = logging.getLogger(__name__)


class SourceError(RuntimeError):
    """The source cannot be listed or read as a whole; the message says what to check."""


@dataclasses.dataclass(frozen=True)
class SourceFile:
    relpath: str  # POSIX path relative to the source root
    local_path: Path | None  # where to read the bytes; None when it must not be read
    size: int
    fingerprint: str  # changes whenever the content may have changed
    problem: str | None = None  # a reason to quarantine without reading


@dataclasses.dataclass
class Listing:
    files: list[SourceFile]
    skipped_dir_links: int = 0
    downloaded: int = 0
    download_bytes: int = 0
    cache_hits: int = 0
    removed_from_cache: int = 0


@dataclasses.dataclass(frozen=True)
class S3Config:
    endpoint_url: str | None = None  # None: AWS; set for MinIO, Ceph, a local endpoint
    region: str | None = None
    profile: str | None = None  # a profile name from ~/.aws; credentials never go in params
    max_retries: int = 5
    backoff_s: float = 0.5
    page_size: int = 1000


def safe_relpath(rel: str) -> str | None:
    """Returns the normalised POSIX relative path, or None if it is absolute or climbs out."""
    parts = rel.split("/")
    if not rel or rel.startswith("/") or "\\" in rel or any(part in ("", ".", "..") for part in parts):
        return None
    return PurePosixPath(rel).as_posix()


def resolve_inside(root: Path, relpath: str) -> Path:
    """Joins a manifest path onto its root, refusing anything that would leave the root."""
    safe = safe_relpath(relpath)
    root = root.resolve()
    path = (root / safe).resolve() if safe else None
    if path is None or not path.is_relative_to(root):
        raise ValueError(f"path {relpath!r} from a manifest is not inside its root {root}")
    return path


class LocalSource:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.uri = str(root)

    @property
    def local_root(self) -> Path:
        return self.root

    def list(self) -> Listing:
        if not self.root.is_dir():
            raise SourceError(
                f"ingest.source {self.root} is not a directory: put the raw videos there, or set "
                "ingest.source in params.yaml to a directory or an s3://bucket/prefix URI")
        real_root = self.root.resolve()
        files: list[SourceFile] = []
        skipped = 0
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            for d in list(dirnames):
                if os.path.islink(os.path.join(dirpath, d)):
                    skipped += 1
            dirnames.sort()
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


def parse_s3_uri(uri: str) -> tuple[str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri}")
    bucket, _, prefix = uri[5:].partition("/")
    if not bucket:
        raise ValueError(f"no bucket in {uri!r}: expected s3://bucket/prefix")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


class S3Source:
    """Syncs ``s3://bucket/prefix`` into ``cache_dir`` and lists the cached copies.

    The client takes credentials from the environment or the named profile only, through boto3's
    own chain; nothing here reads or logs them.
    """

    INDEX = ".s3-index.json"

    def __init__(self, uri: str, cache_dir: str | Path, cfg: S3Config, client: Any = None):
        self.uri = uri
        self.bucket, self.prefix = parse_s3_uri(uri)
        self.cache_dir = Path(cache_dir)
        self.cfg = cfg
        self._client = client

    @property
    def local_root(self) -> Path:
        return self.cache_dir

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3
            from botocore.config import Config

            session = boto3.Session(profile_name=self.cfg.profile) if self.cfg.profile else boto3.Session()
            self._client = session.client(
                "s3", endpoint_url=self.cfg.endpoint_url, region_name=self.cfg.region,
                config=Config(retries={"max_attempts": self.cfg.max_retries, "mode": "standard"}))
        return self._client

    def _index(self) -> dict[str, dict]:
        path = self.cache_dir / self.INDEX
        if path.is_file():
            return json.loads(path.read_text(encoding="utf-8"))
        return {}

    def _objects(self) -> list[dict]:
        paginator = self.client.get_paginator("list_objects_v2")
        out = []
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix,
                                   PaginationConfig={"PageSize": self.cfg.page_size})
        for page in pages:
            out.extend(page.get("Contents", []))
        return out

    def _download(self, key: str, dest: Path, etag: str, size: int) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        for attempt in range(self.cfg.max_retries + 1):
            try:
                resp = self.client.get_object(Bucket=self.bucket, Key=key, IfMatch=etag)
                with atomic_path(dest) as tmp:
                    with open(tmp, "wb") as fh:
                        for chunk in resp["Body"].iter_chunks(1 << 20):
                            fh.write(chunk)
                    got = tmp.stat().st_size
                    if got != size:
                        raise OSError(f"short read: {got} of {size} bytes")
                return
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status < 500 and code not in ("SlowDown", "Throttling", "RequestTimeout"):
                    raise
                err: Exception = exc
            except (BotoCoreError, OSError) as exc:
                err = exc
            if attempt == self.cfg.max_retries:
                raise OSError(f"s3://{self.bucket}/{key}: download failed after {attempt + 1} tries: {err}")
            delay = self.cfg.backoff_s * (2**attempt) * (1 + random.random())
            log.warning("s3://%s/%s: %s; retrying in %.1fs", self.bucket, key, err, delay)
            time.sleep(delay)

    def list(self) -> Listing:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return self._sync()
        except ClientError as exc:
            err = exc.response.get("Error", {})
            raise SourceError(
                f"{self.uri}: S3 answered {err.get('Code', '?')} ({err.get('Message', '')}); check the bucket "
                "and prefix in ingest.source, ingest.s3.endpoint_url, and the credentials in the environment "
                "or ingest.s3.profile") from exc
        except BotoCoreError as exc:
            raise SourceError(f"{self.uri}: {exc}; check ingest.s3.endpoint_url and the network, and that "
                              "credentials are set in the environment or ingest.s3.profile") from exc

    def _sync(self) -> Listing:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        index = self._index()
        listing = Listing(files=[])
        seen: set[str] = set()
        objects = self._objects()
        progress = Progress(log, f"ingest: syncing {self.uri}", len(objects), "objects")
        for obj in objects:
            progress.advance()
            key, size, etag = obj["Key"], int(obj["Size"]), obj["ETag"]
            if key.endswith("/") and size == 0:
                continue  # a "folder" marker object
            rel = safe_relpath(key[len(self.prefix):])
            if rel is None or rel == self.INDEX:
                listing.files.append(SourceFile(key[len(self.prefix):], None, size, etag,
                                                "object key would leave the cache directory"))
                continue
            seen.add(rel)
            dest = self.cache_dir / rel
            entry = index.get(rel)
            if entry and entry["etag"] == etag and entry["size"] == size and dest.is_file() \
                    and dest.stat().st_size == size:
                listing.cache_hits += 1
            else:
                self._download(key, dest, etag, size)
                index[rel] = {"etag": etag, "size": size}
                write_json(index, self.cache_dir / self.INDEX)  # after each object: a kill loses none
                listing.downloaded += 1
                listing.download_bytes += size
            listing.files.append(SourceFile(rel, dest, size, f"{etag}:{size}"))
        for rel in sorted(set(index) - seen):
            stale = self.cache_dir / rel
            if stale.is_file():
                stale.unlink()
            del index[rel]
            listing.removed_from_cache += 1
        write_json(index, self.cache_dir / self.INDEX)
        listing.files.sort(key=lambda f: f.relpath)
        return listing


def local_root(source: str, cache_dir: str | Path) -> Path:
    """Where the files of an ingested source are read from: the directory, or the S3 mirror."""
    return Path(cache_dir) if source.startswith("s3://") else Path(source)


def open_source(uri: str, cache_dir: str | Path, s3: S3Config) -> LocalSource | S3Source:
    if uri.startswith("s3://"):
        return S3Source(uri, cache_dir, s3)
    if "://" in uri:
        raise ValueError(f"ingest.source {uri!r}: only local directories and s3:// URIs are supported")
    return LocalSource(uri)
