"""The S3 source against a real HTTP endpoint: moto's standalone server, started here."""
import contextlib
import json
import logging
import secrets
import sqlite3
import subprocess
import sys
import time

import boto3
import pytest
import yaml
from botocore.exceptions import ClientError, EndpointConnectionError

from longlive_core.config import from_mapping
from longlive_core.data.ingest import IngestConfig, IngestState, ingest
from longlive_core.data.sources import S3Config, S3Source, SourceError

from .conftest import REPO, VENV_BIN, free_port, run

BUCKET = "videos"
SECRET = "s3cret-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def endpoint():
    port = free_port()
    proc = subprocess.Popen([str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            client(url).list_buckets()
            break
        except Exception:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.2)
    yield url
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture(autouse=True)
def fake_credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def client(url):
    return boto3.client("s3", endpoint_url=url, region_name="us-east-1",
                        aws_access_key_id="testing-key-id", aws_secret_access_key=SECRET)


@pytest.fixture
def bucket(endpoint, demo_set, request):
    """A fresh prefix in the bucket holding the demo set; returns (s3 client, prefix uri)."""
    raw, truth = demo_set
    c = client(endpoint)
    with contextlib.suppress(ClientError):  # made by an earlier test
        c.create_bucket(Bucket=BUCKET)
    prefix = f"{request.node.name[:40]}/raw"
    for p in raw.rglob("*"):
        if p.is_file():
            c.upload_file(str(p), BUCKET, f"{prefix}/{p.relative_to(raw).as_posix()}")
    return c, f"s3://{BUCKET}/{prefix}"


def s3_ingest(uri, endpoint, cache, state, c=None, page_size=3):
    cfg = from_mapping(IngestConfig, {"source": uri, "cache_dir": str(cache),
                                      "s3": {"endpoint_url": endpoint, "page_size": page_size}}, "ingest")
    src = S3Source(uri, cache, cfg.s3, client=c)
    listing = src.list()
    return listing, ingest(listing, cfg, IngestState(state), uri)


def test_s3_source_gives_the_same_manifest_as_local(bucket, endpoint, demo_set, tmp_path):
    c, uri = bucket
    raw, truth = demo_set
    n_files = sum(1 for p in raw.rglob("*") if p.is_file())
    listing, out = s3_ingest(uri, endpoint, tmp_path / "cache", tmp_path / "state")
    assert listing.downloaded == n_files  # page_size 3: many pages were walked
    assert dict(zip(out.manifest["path"], out.manifest["status"])) == truth["expected_status"]
    assert (out.manifest["source"] == uri).all()
    for rel in truth["expected_status"]:
        assert (tmp_path / "cache" / rel).read_bytes() == (raw / rel).read_bytes()


def test_s3_rerun_downloads_only_what_changed(bucket, endpoint, tmp_path):
    c, uri = bucket
    prefix = uri.split("/", 3)[3]
    cache, state = tmp_path / "cache", tmp_path / "state"
    first, _ = s3_ingest(uri, endpoint, cache, state)
    again, out = s3_ingest(uri, endpoint, cache, state)
    assert again.downloaded == 0 and again.cache_hits == first.downloaded
    assert (out.counts["hashed"], out.counts["probed"]) == (0, 0)

    c.put_object(Bucket=BUCKET, Key=f"{prefix}/sports/match.json", Body=b'{"caption": "new words"}')
    c.delete_object(Bucket=BUCKET, Key=f"{prefix}/nature/single_take.mp4")
    c.copy_object(Bucket=BUCKET, Key=f"{prefix}/late/arrival.mp4",
                  CopySource={"Bucket": BUCKET, "Key": f"{prefix}/street/market_day.mp4"})
    third, out = s3_ingest(uri, endpoint, cache, state)
    assert third.downloaded == 2 and third.removed_from_cache == 1
    assert not (cache / "nature/single_take.mp4").exists()
    rows = out.manifest.set_index("path")
    assert "nature/single_take.mp4" not in rows.index
    assert rows.loc["late/arrival.mp4", "reason"] == "duplicate of street/market_day.mp4"
    assert rows.loc["sports/match.mp4", "caption_status"] == "ok"


def test_unsafe_object_keys_are_quarantined_not_written(bucket, endpoint, tmp_path):
    c, uri = bucket
    prefix = uri.split("/", 3)[3]
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/a/../../escape.mp4", Body=b"x" * 10)
    _, out = s3_ingest(uri, endpoint, tmp_path / "cache", tmp_path / "state")
    bad = out.manifest[out.manifest["path"].str.contains("escape")]
    assert list(bad["status"]) == ["quarantined"]
    assert bad["reason"].iloc[0] == "object key would leave the cache directory"
    assert not (tmp_path / "escape.mp4").exists()


class FlakyClient:
    """The real client, whose first get_object calls fail as a dropped connection would."""

    def __init__(self, real, failures):
        self.real, self.failures = real, failures

    def get_object(self, **kw):
        if self.failures > 0:
            self.failures -= 1
            raise EndpointConnectionError(endpoint_url="http://flaky")
        return self.real.get_object(**kw)

    def __getattr__(self, name):
        return getattr(self.real, name)


def test_downloads_retry_with_backoff_then_succeed(bucket, endpoint, tmp_path, caplog):
    c, uri = bucket
    flaky = FlakyClient(client(endpoint), failures=2)
    cfg = S3Config(endpoint_url=endpoint, backoff_s=0.01, max_retries=3)
    with caplog.at_level(logging.WARNING):
        listing = S3Source(uri, tmp_path / "cache", cfg, client=flaky).list()
    assert listing.downloaded > 0 and flaky.failures == 0
    assert sum("retrying in" in r.message for r in caplog.records) == 2
    gone = FlakyClient(client(endpoint), failures=99)
    with pytest.raises(OSError, match="download failed after 2 tries"):
        S3Source(uri, tmp_path / "cache2", S3Config(endpoint_url=endpoint, backoff_s=0.01, max_retries=1),
                 client=gone).list()
    # nothing half-written is left behind
    assert not [p for p in (tmp_path / "cache2").rglob("*") if p.is_file() and p.suffix == ".mp4"]


def test_missing_bucket_is_an_error_not_an_empty_listing(endpoint, tmp_path):
    with pytest.raises(SourceError, match="S3 answered NoSuchBucket .*check the bucket"):
        S3Source("s3://no-such-bucket/x", tmp_path / "c", S3Config(endpoint_url=endpoint)).list()


@pytest.mark.slow
def test_ingest_stage_on_s3_never_logs_credentials(bucket, endpoint, tmp_path):
    c, uri = bucket
    work = tmp_path / "work"
    work.mkdir()
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["ingest"]["source"] = uri
    params["ingest"]["s3"]["endpoint_url"] = endpoint
    (work / "params.yaml").write_text(yaml.safe_dump(params))
    proc = run([sys.executable, "-m", "tasks.ingest"], work, AWS_SECRET_ACCESS_KEY=SECRET,
               AWS_ACCESS_KEY_ID="testing-key-id", AWS_DEFAULT_REGION="us-east-1")
    summary = json.loads((work / "reports/ingest/run.json").read_text())
    assert summary["status_ok"] == 5 and summary["s3_downloaded"] > 0
    assert "5 ok, 4 quarantined, 1 duplicate" in proc.stderr
    assert SECRET not in proc.stdout + proc.stderr
    with sqlite3.connect(work / "mlflow.db") as db:
        dump = "\n".join(db.iterdump())
    assert uri in dump and SECRET not in dump
    artifacts = [p for p in (work / "mlartifacts").rglob("*") if p.is_file()]
    assert artifacts and not any(SECRET.encode() in p.read_bytes() for p in artifacts)
