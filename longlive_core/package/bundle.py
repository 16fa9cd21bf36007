"""The model bundle: a folder (or an S3 prefix) with a ``VERSION`` file and ``SHA256SUMS`` covering
every other file, in ``sha256sum``'s format, so ``sha256sum -c SHA256SUMS`` checks it too.

``verify`` refuses a bundle with a missing, changed or unlisted file. On S3 a version is written
once: ``upload`` writes each object only where none is (conditional puts; an object with other bytes
is refused, the same bytes are already published), puts ``SHA256SUMS`` last (a reader that finds it
finds every file) and verifies what landed by reading it back; ``fetch`` downloads a
published version into a staging folder, verifies it, and only then moves it into place.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any

log = logging.getLogger(__name__)
SUMS = "SHA256SUMS"
VERSION = "VERSION"
CHUNK = 8 * 2**20  # multipart size, and the read size when hashing a stream


class BundleError(Exception):
    """A bundle that does not verify, or a version that may not be written; the message says which file."""


def sha256_stream(chunks: Iterator[bytes]) -> str:
    h = hashlib.sha256()
    for chunk in chunks:
        h.update(chunk)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as fh:
        return sha256_stream(iter(lambda: fh.read(CHUNK), b""))


def bundle_files(root: Path) -> list[str]:
    """Every file under ``root`` but SHA256SUMS, as sorted POSIX paths relative to it."""
    return sorted(rel for p in root.rglob("*") if p.is_file() and (rel := p.relative_to(root).as_posix()) != SUMS)


def write_sums(root: Path) -> dict[str, str]:
    sums = {rel: file_sha256(root / rel) for rel in bundle_files(root)}
    (root / SUMS).write_text("".join(f"{digest}  {rel}\n" for rel, digest in sums.items()), encoding="utf-8")
    return sums


def parse_sums(text: str, where: str) -> dict[str, str]:
    sums = {}
    for number, line in enumerate(text.splitlines(), start=1):
        digest, sep, rel = line.partition("  ")
        path = PurePosixPath(rel)
        if not sep or len(digest) != 64 or path.is_absolute() or ".." in path.parts or not rel:
            raise BundleError(f"{where}, line {number}: not '<sha256>  <relative path>'")
        sums[rel] = digest
    if not sums:
        raise BundleError(f"{where} lists no file")
    return sums


def check(sums: dict[str, str], found: dict[str, str | None], where: str) -> None:
    """``found``: path -> digest of what is there (None: not there), for every listed and present file."""
    problems = []
    for rel, digest in sorted(sums.items()):
        got = found.get(rel)
        if got is None:
            problems.append(f"{rel} is missing")
        elif got != digest:
            problems.append(f"{rel} has changed (sha256 {got[:12]}..., SHA256SUMS says {digest[:12]}...)")
    problems += [f"{rel} is not in SHA256SUMS" for rel in sorted(set(found) - set(sums)) if found[rel] is not None]
    if VERSION not in sums:
        problems.append(f"{VERSION} is not in SHA256SUMS")
    if problems:
        raise BundleError(f"{where} does not verify: " + "; ".join(problems))


def verify_dir(root: Path) -> str:
    """The bundle's version, once every file checks out."""
    sums_path = root / SUMS
    if not sums_path.is_file():
        raise BundleError(f"{sums_path} is missing: not a bundle, or one cut short")
    sums = parse_sums(sums_path.read_text(encoding="utf-8"), str(sums_path))
    present = set(bundle_files(root))
    found = {rel: file_sha256(root / rel) if rel in present else None for rel in set(sums) | present}
    check(sums, found, str(root))
    return (root / VERSION).read_text(encoding="utf-8").strip()


# --- S3 ------------------------------------------------------------------------------------------

def split_s3(uri: str, what: str) -> tuple[str, str]:
    """s3://bucket/prefix -> (bucket, 'prefix/' or '')."""
    if not uri.startswith("s3://") or not uri[5:].split("/", 1)[0]:
        raise BundleError(f"{what} {uri!r} is not s3://bucket/prefix")
    bucket, _, prefix = uri[5:].partition("/")
    return bucket, (prefix.strip("/") + "/") if prefix.strip("/") else ""


def _keys(client: Any, bucket: str, prefix: str) -> list[str]:
    keys = []
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        keys += [o["Key"] for o in page.get("Contents", [])]
    return keys


def _object_sha256(client: Any, bucket: str, key: str) -> str:
    body = client.get_object(Bucket=bucket, Key=key)["Body"]
    return sha256_stream(iter(lambda: body.read(CHUNK), b""))


def verify_s3(client: Any, uri: str) -> str:
    """A published version (s3://bucket/prefix/VERSION/), read back whole and hashed; its version."""
    bucket, prefix = split_s3(uri, "the bundle")
    keys = {k[len(prefix):]: k for k in _keys(client, bucket, prefix)}
    if SUMS not in keys:
        raise BundleError(f"{uri} has no {SUMS}: nothing published there, or an upload cut short")
    text = client.get_object(Bucket=bucket, Key=keys[SUMS])["Body"].read().decode("utf-8")
    sums = parse_sums(text, f"{uri}{SUMS}")
    found = {rel: _object_sha256(client, bucket, key) for rel, key in keys.items() if rel != SUMS}
    check(sums, {**{rel: None for rel in sums}, **found}, uri)
    return client.get_object(Bucket=bucket, Key=keys[VERSION])["Body"].read().decode("utf-8").strip()


def _precondition_failed(exc: Exception) -> bool:
    response = getattr(exc, "response", None) or {}
    return (response.get("Error", {}).get("Code") in ("PreconditionFailed", "412")
            or response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 412)


def _put_once(client: Any, bucket: str, key: str, path: Path) -> bool:
    """Writes ``path`` to ``key`` only if nothing is there (a conditional put, multipart for large
    files); True when written. When something is there, it must be these very bytes (a publish cut
    short and run again, or a publisher racing this one with the same bundle): False; other bytes are
    a BundleError, never overwritten."""
    from botocore.exceptions import ClientError

    try:
        if path.stat().st_size <= CHUNK:
            client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes(), IfNoneMatch="*")
        else:
            _multipart_once(client, bucket, key, path)
        return True
    except ClientError as exc:
        if not _precondition_failed(exc):
            raise
    ours, theirs = file_sha256(path), _object_sha256(client, bucket, key)
    if ours != theirs:
        raise BundleError(f"s3://{bucket}/{key} already holds other bytes (sha256 {theirs[:12]}..., this bundle's "
                          f"{ours[:12]}...): a published version is never overwritten; a retrain gets its own "
                          "version from its weights' digest (delete the prefix by hand only to withdraw it)")
    return False


def _multipart_once(client: Any, bucket: str, key: str, path: Path) -> None:
    upload_id = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    try:
        parts = []
        with open(path, "rb") as fh:
            for number, block in enumerate(iter(lambda: fh.read(CHUNK), b""), start=1):
                etag = client.upload_part(Bucket=bucket, Key=key, UploadId=upload_id, PartNumber=number,
                                          Body=block)["ETag"]
                parts.append({"ETag": etag, "PartNumber": number})
        client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id, IfNoneMatch="*",
                                         MultipartUpload={"Parts": parts})
    except BaseException:
        client.abort_multipart_upload(Bucket=bucket, Key=key, UploadId=upload_id)
        raise


def upload(client: Any, root: Path, uri: str) -> str:
    """Publishes the verified bundle ``root`` under ``uri``/<its version>/ and returns that URI. Each
    object is written only where none is (conditional puts): a publish cut short is completed by the
    next run, a second publisher of the same bundle finds its objects there, and any object with
    other bytes is refused. ``SHA256SUMS`` goes last: who sees it sees the whole bundle."""
    version = verify_dir(root)
    bucket, prefix = split_s3(uri, "package.s3_uri")
    target = f"{prefix}{version}/"
    written = sum(_put_once(client, bucket, target + rel, root / rel) for rel in [*bundle_files(root), SUMS])
    published = f"s3://{bucket}/{target}"
    verify_s3(client, published)
    if written <= len(bundle_files(root)):
        log.info("%s: %d object(s) were already there, this bundle's own (an earlier publish of it)", published,
                 len(bundle_files(root)) + 1 - written)
    return published


def fetch(client: Any, uri: str, dest: Path) -> str:
    """Downloads a published version into ``dest`` (which must not exist), verified; its version."""
    from boto3.s3.transfer import TransferConfig

    if dest.exists():
        raise BundleError(f"{dest} exists: fetch into a new folder")
    bucket, prefix = split_s3(uri, "the bundle")
    staging = dest.with_name(f".{dest.name}.fetching")
    shutil.rmtree(staging, ignore_errors=True)
    transfer = TransferConfig(multipart_threshold=CHUNK, multipart_chunksize=CHUNK)
    try:
        keys = _keys(client, bucket, prefix)
        if prefix + SUMS not in keys:
            raise BundleError(f"{uri} has no {SUMS}: nothing published there, or an upload cut short")
        for key in keys:
            rel = PurePosixPath(key[len(prefix):])
            if rel.is_absolute() or ".." in rel.parts:
                raise BundleError(f"{uri}: object {key!r} would land outside the bundle folder")
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            client.download_file(bucket, key, str(staging / rel), Config=transfer)
        version = verify_dir(staging)
        os.replace(staging, dest)
        return version
    finally:
        shutil.rmtree(staging, ignore_errors=True)
