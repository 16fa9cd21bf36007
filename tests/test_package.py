"""The model bundle: checksums that catch every change, S3 publishing against moto's server over
HTTP (verified by reading back, never overwritten, fetched whole), and the registry's aliases."""
from __future__ import annotations

import secrets
from pathlib import Path

import pytest

from longlive_core.cli import main as longlive
from longlive_core.models.folder import write_config
from longlive_core.package.bundle import SUMS, BundleError, fetch, upload, verify_dir, verify_s3, write_sums
from longlive_core.package.config import promotion
from longlive_core.tracking.mlflow_run import RegistryError, StageRun, TrackingConfig

from .helpers.ar_model import folder_config
from .helpers.moto import KEY_ID, REGION, moto_server, s3

SECRET = "s3cret-" + secrets.token_hex(8)
BUCKET = "models"


def make_bundle(root: Path, version: str = "v1-wabc") -> Path:
    (root / "model").mkdir(parents=True)
    (root / "model/model.safetensors").write_bytes(secrets.token_bytes(20 * 2**20))  # multipart-sized
    write_config(folder_config(), root / "model")  # tiny encoders: nothing to check beyond SHA256SUMS
    (root / "README.md").write_text("# card\n")
    (root / "VERSION").write_text(version + "\n")
    write_sums(root)
    return root


@pytest.fixture(scope="module")
def endpoint():
    with moto_server(SECRET) as url:
        s3(url, SECRET).create_bucket(Bucket=BUCKET)
        yield url


@pytest.fixture(autouse=True)
def credentials(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)


def test_a_bundle_verifies_and_any_change_missing_or_extra_file_is_named(tmp_path):
    root = make_bundle(tmp_path / "b")
    assert verify_dir(root) == "v1-wabc"
    assert (root / SUMS).read_text().splitlines()[0].endswith("  README.md")  # sha256sum's format
    config = (root / "model/config.json").read_bytes()
    with open(root / "model/config.json", "a") as fh:
        fh.write(" ")
    with pytest.raises(BundleError, match=r"model/config.json has changed"):
        verify_dir(root)
    (root / "model/config.json").write_bytes(config)
    (root / "extra.txt").write_text("x")
    with pytest.raises(BundleError, match=r"extra.txt is not in SHA256SUMS"):
        verify_dir(root)
    (root / "extra.txt").unlink()
    (root / "README.md").unlink()
    with pytest.raises(BundleError, match=r"README.md is missing"):
        verify_dir(root)
    assert longlive(["bundle", "verify", str(root)]) == 1


def test_publishing_verifies_by_reading_back_never_overwrites_and_fetches_whole(endpoint, tmp_path):
    client = s3(endpoint, SECRET)
    root = make_bundle(tmp_path / "b")
    published = upload(client, root, f"s3://{BUCKET}/longlive")
    assert published == f"s3://{BUCKET}/longlive/v1-wabc/"
    assert verify_s3(client, published) == "v1-wabc"
    assert upload(client, root, f"s3://{BUCKET}/longlive") == published  # already there: this very bundle
    other = make_bundle(tmp_path / "other")  # the same version with other bytes: never over what is published
    with pytest.raises(BundleError, match="already holds other bytes"):
        upload(client, other, f"s3://{BUCKET}/longlive")
    assert verify_s3(client, published) == "v1-wabc"
    assert longlive(["bundle", "verify", published, "--endpoint-url", endpoint]) == 0
    dest = tmp_path / "fetched"
    assert longlive(["bundle", "fetch", published, str(dest), "--endpoint-url", endpoint]) == 0
    assert verify_dir(dest) == "v1-wabc"
    assert (dest / "model/model.safetensors").read_bytes() == (root / "model/model.safetensors").read_bytes()
    # an object changed after publishing: verification and fetching both refuse it, and fetch leaves nothing
    client.put_object(Bucket=BUCKET, Key="longlive/v1-wabc/README.md", Body=b"# edited\n")
    with pytest.raises(BundleError, match="README.md has changed"):
        verify_s3(client, published)
    with pytest.raises(BundleError, match="README.md has changed"):
        fetch(client, published, tmp_path / "again")
    assert not (tmp_path / "again").exists() and not list(tmp_path.glob(".again*"))


def test_candidate_always_moves_and_champion_only_on_a_passing_verdict_of_this_model(tmp_path):
    cfg = TrackingConfig(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", artifact_root=str(tmp_path / "art"))
    bundle = make_bundle(tmp_path / "b")

    def scores(passed, identity, against):
        return {"candidate_identity": identity, "verdict": {"passed": passed, "champion_version": against}}

    def package(name, scores_, identity):
        with StageRun(cfg, "package", repo_root=tmp_path) as run:
            try:
                found = run.registered_alias("longlive-2.0", "champion")
            except RegistryError:
                found = None
            aliases, why = promotion(scores_, identity, found.version if found else None)
            return run.register("longlive-2.0", bundle, aliases, {"bundle.version": name}, identity), why, run._client

    assert package("first", scores(True, "a", None), "a")[:2] == ("1", "the verdict passed against no champion")
    version, why, _ = package("second", scores(False, "b", "1"), "b")
    assert version == "2" and why == "the verdict failed: the champion stays"
    # judged model b, but the folder now holds c (models/w4a4 changed after evaluate)
    version, why, _ = package("third", scores(True, "b", "1"), "c")
    assert version == "3" and "judged another model" in why
    # the verdict compared with version 1; a champion registered since (version 4) must not be overturned by it
    with StageRun(cfg, "package", repo_root=tmp_path) as run:
        assert run.register("longlive-2.0", bundle, ["candidate", "champion"], {}, "d") == "4"
    version, why, client = package("fifth", scores(True, "e", "1"), "e")
    assert version == "5" and "champion changed since the verdict" in why
    assert str(client.get_model_version_by_alias("longlive-2.0", "champion").version) == "4"
    assert str(client.get_model_version_by_alias("longlive-2.0", "candidate").version) == "5"
    # the same weights registered again are the same version: its aliases move, nothing new is made
    version, why, client = package("again", scores(True, "e", "4"), "e")
    assert version == "5" and str(client.get_model_version_by_alias("longlive-2.0", "champion").version) == "5"
    assert len(client.search_model_versions("name='longlive-2.0'")) == 5
    assert client.get_model_version("longlive-2.0", "2").tags["bundle.version"] == "second"
    assert promotion(scores(True, "a", None), "a", None, "the store is down")[0] == ["candidate"]


class CutAfter:
    """An S3 client whose puts fail after ``n`` objects: a network cut in the middle of a publish."""

    def __init__(self, client, n: int):
        self.client, self.left = client, n

    def _count(self):
        if self.left == 0:
            raise ConnectionError("the network went away")
        self.left -= 1

    def put_object(self, **kwargs):
        self._count()
        return self.client.put_object(**kwargs)

    def complete_multipart_upload(self, **kwargs):
        self._count()
        return self.client.complete_multipart_upload(**kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


def test_a_publish_cut_short_is_completed_by_the_next_and_racing_publishers_agree(endpoint, tmp_path):
    """The third object fails: the prefix holds two objects and no SHA256SUMS; the next publish (a
    Prefect retry) writes the rest, where it once refused the prefix for good. Two publishers of one
    bundle at once both end with it published; one of another bundle under the same version is refused."""
    import concurrent.futures

    client = s3(endpoint, SECRET)
    root = make_bundle(tmp_path / "b", version="v2-wcut")
    with pytest.raises(ConnectionError):
        upload(CutAfter(client, 2), root, f"s3://{BUCKET}/cut")
    with pytest.raises(BundleError, match="no SHA256SUMS"):
        verify_s3(client, f"s3://{BUCKET}/cut/v2-wcut/")
    assert upload(client, root, f"s3://{BUCKET}/cut") == f"s3://{BUCKET}/cut/v2-wcut/"
    assert verify_s3(client, f"s3://{BUCKET}/cut/v2-wcut/") == "v2-wcut"

    same = make_bundle(tmp_path / "race", version="v3-wrace")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: upload(s3(endpoint, SECRET), same, f"s3://{BUCKET}/race"), range(2)))
    assert results == [f"s3://{BUCKET}/race/v3-wrace/"] * 2
    # a rival publisher of another bundle under the same version gets in between this one's objects:
    # this one finds the rival's model where it would put its own, and refuses; the rival's stands whole
    # (interleaved by hand: moto's conditional writes are not atomic under concurrent requests, S3's are)
    rival = make_bundle(tmp_path / "rival", version="v4-wrival")
    mine = make_bundle(tmp_path / "mine", version="v4-wrival")
    with pytest.raises(BundleError, match="model/model.safetensors already holds other bytes"):
        upload(RivalFirst(client, lambda: upload(s3(endpoint, SECRET), rival, f"s3://{BUCKET}/rival")), mine,
               f"s3://{BUCKET}/rival")
    assert verify_s3(client, f"s3://{BUCKET}/rival/v4-wrival/") == "v4-wrival"
    theirs = _object(client, "rival/v4-wrival/model/model.safetensors")
    assert theirs == (rival / "model/model.safetensors").read_bytes()


class RivalFirst:
    """An S3 client on which another publisher runs just before this one's first write."""

    def __init__(self, client, rival):
        self.client, self.rival = client, rival

    def put_object(self, **kwargs):
        if self.rival is not None:
            rival, self.rival = self.rival, None
            rival()
        return self.client.put_object(**kwargs)

    def __getattr__(self, name):
        return getattr(self.client, name)


def _object(client, key: str) -> bytes:
    return client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
