"""The S3 source against a real HTTP endpoint: moto's standalone server, started here."""
import contextlib
import json
import logging
import secrets
import sqlite3
import sys
import threading

import pytest
import yaml
from botocore.exceptions import ClientError, EndpointConnectionError

from longlive_core.config import from_mapping
from longlive_core.data import s3_mirror
from longlive_core.data.ingest import IngestConfig, IngestState, ingest
from longlive_core.data.roots import SourceError
from longlive_core.data.s3_mirror import S3Config, S3Source

from .conftest import REPO, run
from .helpers.moto import moto_server, s3

BUCKET = "videos"
SECRET = "s3cret-" + secrets.token_hex(8)


@pytest.fixture(scope="module")
def endpoint():
    with moto_server(SECRET) as url:
        yield url


@pytest.fixture(autouse=True)
def fake_credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing-key-id")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")


def client(url):
    return s3(url, SECRET)


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
        self.lock = threading.Lock()  # downloads run in several threads

    def get_object(self, **kw):
        with self.lock:
            fail = self.failures > 0
            self.failures -= fail
        if fail:
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
    failed = S3Source(uri, tmp_path / "cache2", S3Config(endpoint_url=endpoint, backoff_s=0.01, max_retries=1),
                      client=gone).list()
    # each object is listed with the reason, for ingest to quarantine, rather than one error for all
    assert failed.files and failed.downloaded == 0
    assert all(f.local_path is None and f.problem.startswith("download failed after 2 tries: ")
               for f in failed.files)
    # nothing half-written is left behind, and nothing is in the index
    assert [p.name for p in (tmp_path / "cache2").rglob("*") if p.is_file()] == [S3Source.INDEX]
    assert json.loads((tmp_path / "cache2" / S3Source.INDEX).read_text()) == {}


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


# --- the index journal, parallel downloads and failures of single objects ----------------------------

@pytest.fixture
def empty_prefix(endpoint, request):
    """A fresh, empty prefix in the bucket; returns (s3 client, prefix uri, key prefix)."""
    c = client(endpoint)
    with contextlib.suppress(ClientError):
        c.create_bucket(Bucket=BUCKET)
    prefix = f"{request.node.name[:40]}/raw"
    return c, f"s3://{BUCKET}/{prefix}", prefix


def journal_lines(cache):
    path = cache / S3Source.JOURNAL
    return path.read_text(encoding="utf-8").splitlines() if path.exists() else []


def test_a_sync_journals_each_download_and_writes_the_snapshot_once(bucket, endpoint, tmp_path, monkeypatch):
    c, uri = bucket
    cache = tmp_path / "cache"
    snapshots = []  # the journal's lines at each snapshot write
    real_write_json = s3_mirror.write_json

    def spy(obj, target):
        if target.name == S3Source.INDEX:
            snapshots.append(journal_lines(cache))
        real_write_json(obj, target)

    monkeypatch.setattr(s3_mirror, "write_json", spy)
    listing = S3Source(uri, cache, S3Config(endpoint_url=endpoint, download_workers=4)).list()
    n = listing.downloaded
    assert n == len(listing.files) > 10
    assert len(snapshots) == 1 and len(snapshots[0]) == n  # not one rewrite per object
    assert {json.loads(line)["path"] for line in snapshots[0]} == {f.relpath for f in listing.files}
    assert not (cache / S3Source.JOURNAL).exists()
    # the snapshot keeps the format of the index before the journal: path -> etag and size
    index = json.loads((cache / S3Source.INDEX).read_text())
    assert index == {f.relpath: {"etag": f.fingerprint.rsplit(":", 1)[0], "size": f.size} for f in listing.files}
    snapshots.clear()
    again = S3Source(uri, cache, S3Config(endpoint_url=endpoint)).list()
    assert (again.downloaded, again.cache_hits, snapshots) == (0, n, [])  # nothing changed, nothing written


def test_an_index_from_before_the_journal_is_kept(bucket, endpoint, tmp_path):
    c, uri = bucket
    cache = tmp_path / "cache"
    first = S3Source(uri, cache, S3Config(endpoint_url=endpoint)).list()
    # as the mirror wrote it before the journal existed
    old = {f.relpath: {"etag": f.fingerprint.rsplit(":", 1)[0], "size": f.size} for f in first.files}
    (cache / S3Source.INDEX).write_text(json.dumps(old, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
    again = S3Source(uri, cache, S3Config(endpoint_url=endpoint)).list()
    assert again.downloaded == 0 and again.cache_hits == len(old)


def test_a_killed_sync_keeps_its_finished_downloads(bucket, endpoint, tmp_path, monkeypatch):
    c, uri = bucket
    cache = tmp_path / "cache"
    real_download = S3Source._download
    calls, finished = [], []
    lock = threading.Lock()

    def download(self, key, dest, etag, size):
        with lock:
            calls.append(key)
            if len(calls) == 6:
                raise KeyboardInterrupt  # as Ctrl-C or a kill would stop it
        real_download(self, key, dest, etag, size)
        with lock:
            finished.append(key)

    monkeypatch.setattr(S3Source, "_download", download)
    with pytest.raises(KeyboardInterrupt):
        S3Source(uri, cache, S3Config(endpoint_url=endpoint, download_workers=3)).list()
    monkeypatch.setattr(S3Source, "_download", real_download)
    assert len(finished) >= 5  # the five before the kill ended, and were kept
    assert len(journal_lines(cache)) == len(finished) and not (cache / S3Source.INDEX).exists()
    with open(cache / S3Source.JOURNAL, "a", encoding="utf-8") as fh:
        fh.write('{"path": "nature/forest_wa')  # killed while writing a line
    rerun = S3Source(uri, cache, S3Config(endpoint_url=endpoint)).list()
    assert rerun.cache_hits == len(finished)
    assert rerun.downloaded == len(rerun.files) - len(finished)
    assert not (cache / S3Source.JOURNAL).exists()
    assert len(json.loads((cache / S3Source.INDEX).read_text())) == len(rerun.files)


class CountingPool(s3_mirror.ThreadPoolExecutor):
    """Records the most downloads that were submitted and not yet finished at one time."""

    most = 0

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.open, self.lock = 0, threading.Lock()

    def submit(self, fn, *a, **kw):
        with self.lock:
            self.open += 1
            CountingPool.most = max(CountingPool.most, self.open)
        fut = super().submit(fn, *a, **kw)
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _fut):
        with self.lock:
            self.open -= 1


def test_downloads_run_in_parallel_with_a_bounded_queue(bucket, endpoint, tmp_path, monkeypatch):
    c, uri = bucket
    together = threading.Barrier(3, timeout=20)  # passes only if three downloads run at once

    class MeetingClient(FlakyClient):
        def get_object(self, **kw):
            with self.lock:
                self.failures -= 1
                meet = self.failures >= 0
            if meet:
                together.wait()
            return self.real.get_object(**kw)

    monkeypatch.setattr(s3_mirror, "ThreadPoolExecutor", CountingPool)
    monkeypatch.setattr(CountingPool, "most", 0)
    listing = S3Source(uri, tmp_path / "cache", S3Config(endpoint_url=endpoint, download_workers=3),
                       client=MeetingClient(client(endpoint), failures=3)).list()
    assert listing.downloaded == len(listing.files) > 10
    assert 3 <= CountingPool.most <= 6  # twice the threads, not every object at once


def test_a_failed_download_is_quarantined_and_tried_again_next_run(bucket, endpoint, tmp_path):
    c, uri = bucket
    cache, state = tmp_path / "cache", tmp_path / "state"

    class DenyingClient(FlakyClient):
        def get_object(self, **kw):
            if kw["Key"].endswith("sports/match.mp4"):
                raise ClientError({"Error": {"Code": "AccessDenied", "Message": "Access Denied"},
                                   "ResponseMetadata": {"HTTPStatusCode": 403}}, "GetObject")
            return self.real.get_object(**kw)

    first, out = s3_ingest(uri, endpoint, cache, state, c=DenyingClient(client(endpoint), 0))
    rows = out.manifest.set_index("path")
    assert rows.loc["sports/match.mp4", "status"] == "quarantined"
    assert rows.loc["sports/match.mp4", "reason"] == (
        "download failed: S3 answered AccessDenied (Access Denied); the next run tries again")
    assert (rows["status"] == "ok").sum() == 4  # the others went on
    assert "sports/match.mp4" not in json.loads((cache / S3Source.INDEX).read_text())
    assert not (cache / "sports/match.mp4").exists()
    again, out = s3_ingest(uri, endpoint, cache, state)
    assert again.downloaded == 1 and again.cache_hits == first.downloaded
    assert out.manifest.set_index("path").loc["sports/match.mp4", "status"] == "ok"


def test_a_sync_gives_up_when_downloads_keep_failing(bucket, endpoint, tmp_path, monkeypatch):
    c, uri = bucket
    monkeypatch.setattr(S3Source, "GIVE_UP_AFTER", 4)
    ok_first = FlakyClient(client(endpoint), failures=0)
    real_get = ok_first.get_object
    served = []

    def get_object(**kw):  # two objects come down, then the endpoint goes away
        if len(served) >= 2:
            raise EndpointConnectionError(endpoint_url="http://gone")
        served.append(kw["Key"])
        return real_get(**kw)

    ok_first.get_object = get_object
    cfg = S3Config(endpoint_url=endpoint, backoff_s=0.0, max_retries=0, download_workers=1)
    with pytest.raises(SourceError, match=r"4 downloads in a row failed .*check ingest.s3.endpoint_url"):
        S3Source(uri, tmp_path / "cache", cfg, client=ok_first).list()
    assert len(journal_lines(tmp_path / "cache")) == 2  # the finished ones are kept for the next run


# --- keys the mirror cannot hold -------------------------------------------------------------------

def test_keys_that_clash_with_folders_are_quarantined_and_the_rest_synced(bucket, endpoint, tmp_path):
    c, uri = bucket
    prefix = uri.split("/", 3)[3]
    c.copy_object(Bucket=BUCKET, Key=f"{prefix}/nature/single_take.mp4/extra.mp4",
                  CopySource={"Bucket": BUCKET, "Key": f"{prefix}/street/market_day.mp4"})
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/clip", Body=b"x" * 5)
    c.put_object(Bucket=BUCKET, Key=f"{prefix}/clip/x.mp4", Body=b"y" * 5)
    listing, out = s3_ingest(uri, endpoint, tmp_path / "cache", tmp_path / "state")
    problems = {f.relpath: f.problem for f in listing.files if f.problem}
    assert problems == {
        "nature/single_take.mp4": "object key clashes with the folder of other keys "
                                  "(nature/single_take.mp4/extra.mp4): rename it in the bucket",
        "clip": "object key clashes with the folder of other keys (clip/x.mp4): rename it in the bucket"}
    rows = out.manifest.set_index("path")
    assert rows.loc["nature/single_take.mp4", "status"] == "quarantined"
    assert rows.loc["nature/single_take.mp4", "reason"] == problems["nature/single_take.mp4"]
    # the key under the clashing one is ingested: its content is the one of street/market_day.mp4
    assert rows.loc["nature/single_take.mp4/extra.mp4", "status"] == "ok"
    assert rows.loc["street/market_day.mp4", "reason"] == "duplicate of nature/single_take.mp4/extra.mp4"
    assert (tmp_path / "cache/clip/x.mp4").read_bytes() == b"y" * 5


def test_stale_mirror_files_make_way_for_new_keys(empty_prefix, endpoint, tmp_path):
    c, uri, prefix = empty_prefix
    cache = tmp_path / "cache"
    cfg = S3Config(endpoint_url=endpoint, backoff_s=0.01, max_retries=1)
    for key in ("a", "b/x.mp4", "clip"):
        c.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"old")
    assert S3Source(uri, cache, cfg).list().downloaded == 3
    (cache / "untracked").write_bytes(b"left by someone")  # not in the index
    c.delete_objects(Bucket=BUCKET, Delete={"Objects": [{"Key": f"{prefix}/a"}, {"Key": f"{prefix}/b/x.mp4"}]})
    for key in ("a/x.mp4", "b", "clip/y.mp4", "untracked/z.mp4"):  # each needs a file or folder gone
        c.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"new")
    listing = S3Source(uri, cache, cfg).list()
    assert {f.relpath: f.problem for f in listing.files if f.problem} == {
        "clip": "object key clashes with the folder of other keys (clip/y.mp4): rename it in the bucket"}
    assert listing.downloaded == 4 and listing.removed_from_cache == 3  # a, b/x.mp4 and the clashing clip
    for rel in ("a/x.mp4", "b", "clip/y.mp4", "untracked/z.mp4"):
        assert (cache / rel).read_bytes() == b"new"
    assert sorted(json.loads((cache / S3Source.INDEX).read_text())) == [
        "a/x.mp4", "b", "clip/y.mp4", "untracked/z.mp4"]


def test_keys_named_like_the_index_are_refused(empty_prefix, endpoint, tmp_path):
    c, uri, prefix = empty_prefix
    cache = tmp_path / "cache"
    for key in (S3Source.INDEX, S3Source.JOURNAL, f"{S3Source.JOURNAL}/x.mp4", "fine.mp4"):
        c.put_object(Bucket=BUCKET, Key=f"{prefix}/{key}", Body=b"not an index")
    listing = S3Source(uri, cache, S3Config(endpoint_url=endpoint)).list()
    problems = {f.relpath: f.problem for f in listing.files if f.problem}
    assert sorted(problems) == sorted([S3Source.INDEX, S3Source.JOURNAL, f"{S3Source.JOURNAL}/x.mp4"])
    assert problems[S3Source.JOURNAL] == (
        f"object key uses the name {S3Source.JOURNAL}, which the mirror keeps for its index: rename it in the bucket")
    assert json.loads((cache / S3Source.INDEX).read_text()).keys() == {"fine.mp4"}
    assert not (cache / S3Source.JOURNAL).exists()
