"""An ``s3://bucket/prefix`` source, mirrored into a local cache directory.

A sync downloads only new or changed objects (by ETag and size), several at a time, and deletes
mirrored files whose objects are gone; the listing it gives is the mirror's. Object keys that
would leave the cache directory, or that clash with the folder of other keys, are listed with a
problem (ingest quarantines them) and never downloaded.

The mirror remembers what it holds in an index: a snapshot (``.s3-index.json``, path -> ETag
and size) and, while a sync runs, a journal beside it (``.s3-index.journal``) with one JSON line
per finished download. Appending a line costs the same at 120 000 objects as at 10, where
rewriting the whole index after each object did not; a killed sync keeps what the journal holds,
and the next one replays it and downloads only the rest.

The client takes credentials from the environment or the named profile only, through boto3's own
chain; nothing here reads or logs them.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import random
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TextIO

from longlive_core.config import ConfigError
from longlive_core.data.listing import Listing, SourceFile
from longlive_core.data.roots import SourceError, safe_relpath
from longlive_core.data.sources import check_source_uri
from longlive_core.io.atomic import atomic_path, write_json
from longlive_core.progress import Progress

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class S3Config:
    endpoint_url: str | None = None  # None: AWS; set for MinIO, Ceph, a local endpoint
    region: str | None = None
    profile: str | None = None  # a profile name from ~/.aws; credentials never go in params
    max_retries: int = 5
    backoff_s: float = 0.5
    page_size: int = 1000
    download_workers: int = 8  # objects downloaded at once

    def validate(self, where: str) -> None:
        if self.download_workers < 1:
            raise ConfigError(f"{where}.download_workers must be >= 1, got {self.download_workers}")
        if self.max_retries < 0:
            raise ConfigError(f"{where}.max_retries must be >= 0 (0: no retries), got {self.max_retries}")
        if self.backoff_s < 0:
            raise ConfigError(f"{where}.backoff_s must be >= 0, got {self.backoff_s}")
        if not 1 <= self.page_size <= 1000:
            raise ConfigError(f"{where}.page_size must be between 1 and 1000 (S3 lists at most 1000 keys "
                              f"a page), got {self.page_size}")


def s3_client(cfg: S3Config) -> Any:
    """A boto3 S3 client for ``cfg``: credentials from the environment or the profile, never params;
    botocore's standard retries with backoff."""
    import boto3
    from botocore.config import Config

    session = boto3.Session(profile_name=cfg.profile) if cfg.profile else boto3.Session()
    return session.client("s3", endpoint_url=cfg.endpoint_url, region_name=cfg.region,
                          config=Config(retries={"max_attempts": cfg.max_retries, "mode": "standard"},
                                        max_pool_connections=max(10, cfg.download_workers)))


def parse_s3_uri(uri: str) -> tuple[str, str]:
    check_source_uri(uri)
    if not uri.startswith("s3://"):
        raise SourceError(f"not an s3:// URI: {uri}")
    bucket, _, prefix = uri[5:].partition("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def folder_clashes(paths: Iterable[str]) -> dict[str, list[str]]:
    """The paths that other paths need as a folder, each with those other paths (sorted).

    A mirror cannot hold a file and a folder at one path, so such a path cannot be mirrored."""
    paths = set(paths)
    clashes: dict[str, list[str]] = {}
    for path in sorted(paths):
        parts = path.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in paths:
                clashes.setdefault(folder, []).append(path)
    return clashes


def _fsync_dir(path: Path) -> None:
    """Makes renames and new names in ``path`` durable, not only the files' bytes."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@dataclasses.dataclass(frozen=True)
class _Object:
    key: str  # the S3 key
    rel: str  # its path in the mirror
    etag: str
    size: int

    @property
    def fingerprint(self) -> str:
        return f"{self.etag}:{self.size}"


def _index_entry(rel: Any, entry: Any) -> tuple[str, dict] | None:
    """A well-formed index entry, or None: a hand-edited or damaged index must not make the sync
    delete or trust files it should not."""
    if not isinstance(rel, str) or safe_relpath(rel) != rel or not isinstance(entry, dict):
        return None
    etag, size = entry.get("etag"), entry.get("size")
    if not isinstance(etag, str) or isinstance(size, bool) or not isinstance(size, int):
        return None
    return rel, {"etag": etag, "size": size}


class _Journal:
    """Appends one JSON line per finished download to the journal file.

    Each line is flushed at once, so a killed process loses none; the file is fsynced every
    SYNC_EVERY lines or SYNC_S seconds, so a power cut loses at most those, whose objects are
    simply downloaded again. The file of a line was renamed into place and its folder fsynced
    before the line was written, so a line never vouches for a file that is not on disk.
    """

    SYNC_EVERY = 100
    SYNC_S = 2.0

    def __init__(self, fh: TextIO):
        self._fh = fh
        self._unsynced = 0
        self._last_sync = time.monotonic()

    def append(self, rel: str, etag: str, size: int) -> None:
        self._fh.write(json.dumps({"path": rel, "etag": etag, "size": size}, ensure_ascii=False) + "\n")
        self._fh.flush()
        self._unsynced += 1
        if self._unsynced >= self.SYNC_EVERY or time.monotonic() - self._last_sync >= self.SYNC_S:
            self.sync()

    def sync(self) -> None:
        if self._unsynced:
            os.fsync(self._fh.fileno())
        self._unsynced = 0
        self._last_sync = time.monotonic()


@contextlib.contextmanager
def _open_journal(path: Path) -> Iterator[_Journal]:
    with open(path, "a", encoding="utf-8") as fh:
        _fsync_dir(path.parent)
        journal = _Journal(fh)
        try:
            yield journal
        finally:
            journal.sync()


def _replay_journal(path: Path, index: dict[str, dict]) -> int:
    """Applies the journal's lines to ``index``; returns how many lines were unreadable (the last
    one is cut short when a sync was killed while writing it)."""
    bad = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            try:
                rec = json.loads(line)
            except ValueError:
                bad += 1
                continue
            entry = _index_entry(rec.get("path"), rec) if isinstance(rec, dict) else None
            if entry is None:
                bad += 1
                continue
            index[entry[0]] = entry[1]
    return bad


class DownloadError(Exception):
    """One object could not be downloaded; the message is the reason ingest quarantines it with."""


class S3Source:
    """Syncs ``s3://bucket/prefix`` into ``cache_dir`` and lists the mirrored copies."""

    INDEX = ".s3-index.json"
    JOURNAL = ".s3-index.journal"
    GIVE_UP_AFTER = 20  # downloads failing in a row: the endpoint is gone, not one object

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
        if self._client is None:  # made once, before the download threads share it
            self._client = s3_client(self.cfg)
        return self._client

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

    # --- the index --------------------------------------------------------------------------------

    def _load_index(self) -> tuple[dict[str, dict], bool]:
        """The snapshot with a killed sync's journal replayed; and whether there was a journal."""
        index: dict[str, dict] = {}
        snapshot = self.cache_dir / self.INDEX
        if snapshot.is_file():
            try:
                raw = json.loads(snapshot.read_text(encoding="utf-8"))
            except ValueError:
                log.warning("%s is damaged: every object is checked against S3 again", snapshot)
                raw = {}
            index = dict(e for rel, v in (raw.items() if isinstance(raw, dict) else ())
                         if (e := _index_entry(rel, v)) is not None)
        journal = self.cache_dir / self.JOURNAL
        if not journal.is_file():
            return index, False
        bad = _replay_journal(journal, index)
        if bad:
            log.warning("%s: %d unreadable line(s) skipped (a sync killed while writing); those objects "
                        "are downloaded again", journal, bad)
        return index, True

    def _save_index(self, index: dict[str, dict]) -> None:
        write_json(index, self.cache_dir / self.INDEX)
        (self.cache_dir / self.JOURNAL).unlink(missing_ok=True)

    # --- the listing and what to do with it -------------------------------------------------------

    def _objects(self) -> list[dict]:
        paginator = self.client.get_paginator("list_objects_v2")
        out = []
        pages = paginator.paginate(Bucket=self.bucket, Prefix=self.prefix,
                                   PaginationConfig={"PageSize": self.cfg.page_size})
        for page in pages:
            out.extend(page.get("Contents", []))
        return out

    def _plan(self, objects: list[dict]) -> tuple[dict[str, _Object], list[SourceFile]]:
        """The objects the mirror can hold, by path, and the ones it cannot, listed with the reason."""
        wanted: dict[str, _Object] = {}
        refused: list[SourceFile] = []
        for obj in objects:
            key, size, etag = obj["Key"], int(obj["Size"]), obj["ETag"]
            if key.endswith("/") and size == 0:
                continue  # a "folder" marker object
            rel = key[len(self.prefix):]
            reserved = next((n for n in (self.INDEX, self.JOURNAL) if rel == n or rel.startswith(n + "/")), None)
            if safe_relpath(rel) != rel:
                refused.append(SourceFile(rel, None, size, etag, "object key would leave the cache directory"))
            elif reserved:
                refused.append(SourceFile(rel, None, size, etag, f"object key uses the name {reserved}, which the "
                                          "mirror keeps for its index: rename it in the bucket"))
            else:
                wanted[rel] = _Object(key, rel, etag, size)
        for rel, others in folder_clashes(wanted).items():
            obj = wanted.pop(rel)
            shown = ", ".join(others[:3]) + (" ..." if len(others) > 3 else "")
            refused.append(SourceFile(rel, None, obj.size, obj.fingerprint, f"object key clashes with the folder "
                                      f"of other keys ({shown}): rename it in the bucket"))
        return wanted, refused

    def _remove(self, rel: str) -> None:
        """Deletes a mirrored file and the folders it leaves empty."""
        path = self.cache_dir / rel
        if path.is_file() or path.is_symlink():
            path.unlink()
        folder = path.parent
        while folder != self.cache_dir and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent

    def _clear_way(self, rel: str) -> str | None:
        """Makes room for ``rel``: a stray file where one of its folders must go is removed (the index
        has no such file: it would have been removed as stale). Returns a problem, or None."""
        parts = rel.split("/")
        for i in range(1, len(parts)):
            folder = self.cache_dir.joinpath(*parts[:i])
            if folder.is_file() or folder.is_symlink():
                log.warning("removing %s from the S3 mirror: it is no object's copy, and the folder of %s "
                            "needs its place", folder, rel)
                folder.unlink()
        dest = self.cache_dir / rel
        if dest.is_dir():
            if any(dest.iterdir()):
                return (f"a folder of files that are no object's copies is in the way at {dest}: "
                        "remove it from the mirror")
            dest.rmdir()
        return None

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
                _fsync_dir(dest.parent)
                return
            except ClientError as exc:
                err_info = exc.response.get("Error", {})
                code = err_info.get("Code", "")
                status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
                if status < 500 and code not in ("SlowDown", "Throttling", "RequestTimeout"):
                    raise DownloadError(f"download failed: S3 answered {code or status} "
                                        f"({err_info.get('Message', '')})") from exc
                err: Exception = exc
            except (BotoCoreError, OSError) as exc:
                err = exc
            if attempt == self.cfg.max_retries:
                raise DownloadError(f"download failed after {attempt + 1} tries: {err}")
            delay = self.cfg.backoff_s * (2**attempt) * (1 + random.random())
            log.warning("s3://%s/%s: %s; retrying in %.1fs", self.bucket, key, err, delay)
            time.sleep(delay)

    def _sync(self) -> Listing:
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        index, had_journal = self._load_index()
        wanted, refused = self._plan(self._objects())
        listing = Listing(files=refused)
        for rel in sorted(set(index) - set(wanted)):  # objects gone (or now refused): their copies go
            self._remove(rel)
            del index[rel]
            listing.removed_from_cache += 1
        todo = []
        for rel, obj in sorted(wanted.items()):
            entry, dest = index.get(rel), self.cache_dir / rel
            if entry == {"etag": obj.etag, "size": obj.size} and dest.is_file() and dest.stat().st_size == obj.size:
                listing.cache_hits += 1
                listing.files.append(SourceFile(rel, dest, obj.size, obj.fingerprint))
            else:
                index.pop(rel, None)  # changed: the old copy is not vouched for until the new one is in
                todo.append(obj)
        if todo:
            self._mirror(todo, index, listing)
        if todo or listing.removed_from_cache or had_journal or not (self.cache_dir / self.INDEX).is_file():
            self._save_index(index)
        listing.files.sort(key=lambda f: f.relpath)
        return listing

    def _mirror(self, todo: list[_Object], index: dict[str, dict], listing: Listing) -> None:
        """Downloads ``todo`` with ``download_workers`` threads, at most twice that many queued; each
        finished download is journaled at once. An interrupt lets the running downloads finish (and be
        journaled) and starts no more."""
        progress = Progress(log, f"ingest: downloading {self.uri}", len(todo), "objects")
        failed_in_a_row, failed = 0, 0
        stop: BaseException | None = None
        pending = iter(todo)
        with _open_journal(self.cache_dir / self.JOURNAL) as journal, \
                ThreadPoolExecutor(max_workers=self.cfg.download_workers) as pool:
            running: dict[Future, _Object] = {}
            while True:
                while stop is None and len(running) < 2 * self.cfg.download_workers:
                    obj = next(pending, None)
                    if obj is None:
                        break
                    problem = self._clear_way(obj.rel)
                    if problem:
                        listing.files.append(SourceFile(obj.rel, None, obj.size, obj.fingerprint, problem))
                        continue
                    running[pool.submit(self._download, obj.key, self.cache_dir / obj.rel, obj.etag,
                                        obj.size)] = obj
                if not running:
                    break
                try:
                    done, _ = wait(running, return_when=FIRST_COMPLETED)
                except BaseException as exc:  # Ctrl-C while waiting: finish what runs, journal it, stop
                    stop = exc
                    continue
                for fut in done:
                    obj = running.pop(fut)
                    progress.advance()
                    exc = fut.exception()
                    if exc is None:
                        journal.append(obj.rel, obj.etag, obj.size)
                        index[obj.rel] = {"etag": obj.etag, "size": obj.size}
                        listing.downloaded += 1
                        listing.download_bytes += obj.size
                        listing.files.append(SourceFile(obj.rel, self.cache_dir / obj.rel, obj.size,
                                                        obj.fingerprint))
                        failed_in_a_row = 0
                    elif isinstance(exc, DownloadError):
                        failed += 1
                        failed_in_a_row += 1
                        listing.files.append(SourceFile(obj.rel, None, obj.size, obj.fingerprint,
                                                        f"{exc}; the next run tries again"))
                        if failed_in_a_row >= self.GIVE_UP_AFTER and stop is None:
                            stop = SourceError(
                                f"{self.uri}: {failed_in_a_row} downloads in a row failed (the last: {exc}); "
                                "check ingest.s3.endpoint_url, the network and the credentials; the finished "
                                "downloads are kept for the next run")
                    elif stop is None:
                        stop = exc  # a kill, or a bug: no more downloads start
        if stop is not None:
            raise stop
        if failed:
            log.warning("ingest: %d of %d download(s) failed; those objects are quarantined in this run and "
                        "tried again by the next", failed, len(todo))
