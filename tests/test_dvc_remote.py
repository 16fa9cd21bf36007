"""The DVC remote on S3 (dvc-s3) against moto's server over HTTP, set up as docs/dvc-remote.md tells a
team to: `dvc push` after `dvc repro`, `dvc pull` in a fresh clone, credentials only from the
environment or a credentials file, never in .dvc/config."""
from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.request
from pathlib import Path

import boto3
import pytest
from botocore.exceptions import ClientError

from .conftest import run
from .helpers.moto import REGION, moto_server, s3

BUCKET = "longlive-dvc"
BOOT_SECRET = "boot-only-secret"  # moto checks no signature until auth is switched on below
PROFILE = "pipeline-team"
DVC = [sys.executable, "-m", "dvc"]
POLICY = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}


def enforce_auth(url: str) -> tuple[str, str]:
    """An IAM user allowed on S3 and its key pair, then moto's signature and policy checks switched on
    (it accepts any key until then): a wrong secret is refused from here on."""
    iam = boto3.client("iam", endpoint_url=url, region_name=REGION, aws_access_key_id="boot",
                       aws_secret_access_key=BOOT_SECRET)
    iam.create_user(UserName="dvc")
    iam.put_user_policy(UserName="dvc", PolicyName="s3", PolicyDocument=json.dumps(POLICY))
    key = iam.create_access_key(UserName="dvc")["AccessKey"]
    s3(url, BOOT_SECRET).create_bucket(Bucket=BUCKET)
    # a form-encoded body reaches moto empty: send the count as plain text
    req = urllib.request.Request(f"{url}/moto-api/reset-auth", data=b"0", method="POST",
                                 headers={"Content-Type": "text/plain"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        assert resp.status == 200
    return key["AccessKeyId"], key["SecretAccessKey"]


def client(url: str, key_id: str, secret: str):
    return boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=key_id,
                        aws_secret_access_key=secret)


def bucket_keys(url: str, key_id: str, secret: str) -> set[str]:
    pages = client(url, key_id, secret).get_paginator("list_objects_v2").paginate(Bucket=BUCKET)
    return {obj["Key"] for page in pages for obj in page.get("Contents", [])}


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def git(repo: Path, *args: str) -> None:
    run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], repo)


@pytest.mark.slow
def test_push_to_s3_and_pull_into_a_fresh_clone_with_credentials_only_outside_the_repo(
        repo_copy, tmp_path, monkeypatch):
    for name in [k for k in os.environ if k.startswith("AWS_")]:  # nothing from the caller's AWS setup
        monkeypatch.delenv(name)
    aws = tmp_path / "aws"
    base = {"DVC_SITE_CACHE_DIR": str(tmp_path / "dvc-site"), "AWS_DEFAULT_REGION": REGION,
            "AWS_CONFIG_FILE": str(aws / "config"), "AWS_SHARED_CREDENTIALS_FILE": str(aws / "credentials")}
    run([*DVC, "repro", "demo_data"], repo_copy, **base)
    outputs = {"data/demo/raw": tree(repo_copy / "data/demo/raw"),
               "data/demo/truth.json": (repo_copy / "data/demo/truth.json").read_bytes()}
    assert len(outputs["data/demo/raw"]) > 5

    with moto_server(BOOT_SECRET) as url:
        key_id, secret = enforce_auth(url)
        with pytest.raises(ClientError):  # the check below is meaningful only if moto refuses a wrong secret
            client(url, key_id, "wrong-" + secret).list_objects_v2(Bucket=BUCKET)
        env = {**base, "AWS_ACCESS_KEY_ID": key_id, "AWS_SECRET_ACCESS_KEY": secret}

        # the remote as the docs set it up: URL and endpoint committed, no credentials
        run([*DVC, "remote", "add", "-d", "storage", f"s3://{BUCKET}/dvc"], repo_copy, **base)
        run([*DVC, "remote", "modify", "storage", "endpointurl", url], repo_copy, **base)

        # wrong credentials: the push fails, says nothing secret, and leaves the bucket empty
        wrong = "wrong-" + secret
        bad = run([*DVC, "push"], repo_copy, check=False, **{**env, "AWS_SECRET_ACCESS_KEY": wrong})
        assert bad.returncode != 0, bad.stdout + bad.stderr
        for text in (wrong, secret):
            assert text not in bad.stdout + bad.stderr
        assert bucket_keys(url, key_id, secret) == set()

        pushed = run([*DVC, "push"], repo_copy, **env)
        assert secret not in pushed.stdout + pushed.stderr
        # every object of the cached outputs is pushed (each file, the .dir listing, truth.json, the
        # stage's run.json; not runs/, the run cache, without --run-cache)
        cache = repo_copy / ".dvc/cache"
        cached = {p.relative_to(cache).as_posix() for p in (cache / "files/md5").rglob("*") if p.is_file()}
        metric = hashlib.md5((repo_copy / "reports/demo_data/run.json").read_bytes()).hexdigest()
        assert f"files/md5/{metric[:2]}/{metric[2:]}" in cached
        assert len(cached) > len(outputs["data/demo/raw"])
        assert bucket_keys(url, key_id, secret) == {f"dvc/{k}" for k in cached}
        for name in ("config", "config.local"):  # no credentials at all, not even the key id
            path = repo_copy / ".dvc" / name
            assert not path.exists() or (secret not in path.read_text() and key_id not in path.read_text())
        assert f"url = s3://{BUCKET}/dvc" in (repo_copy / ".dvc/config").read_text()

        # a fresh machine: clone what git holds (dvc.lock, .dvc/config), credentials from a profile
        git(repo_copy, "add", "dvc.lock", ".dvc/config")
        git(repo_copy, "commit", "-qm", "demo_data outputs on the S3 remote")
        clone = tmp_path / "clone"
        git(tmp_path, "clone", "-q", str(repo_copy), str(clone))
        assert not (clone / "data").exists() and not (clone / ".dvc/cache").exists()
        aws.mkdir()
        (aws / "credentials").write_text(
            f"[{PROFILE}]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
        run([*DVC, "remote", "modify", "--local", "storage", "profile", PROFILE], clone, **base)
        assert f"profile = {PROFILE}" in (clone / ".dvc/config.local").read_text()
        for name in ("config", "config.local"):
            assert secret not in (clone / ".dvc" / name).read_text()
        status = run(["git", "status", "--porcelain"], clone).stdout
        assert status == "", status  # config.local is ignored by git, nothing to commit by mistake

        # `dvc pull` with no target fails while dvc.lock lacks the stages not run yet: name the stage
        pulled = run([*DVC, "pull", "demo_data"], clone, **base)
        assert secret not in pulled.stdout + pulled.stderr
        assert tree(clone / "data/demo/raw") == outputs["data/demo/raw"]
        assert (clone / "data/demo/truth.json").read_bytes() == outputs["data/demo/truth.json"]
        cloud = run([*DVC, "status", "--cloud", "demo_data"], clone, **base).stdout
        assert "Cache and remote 'storage' are in sync" in cloud, cloud

    # the reports come back with the data (they are cached outputs), so the new machine has nothing to rerun
    report = "reports/demo_data/run.json"
    assert (clone / report).read_bytes() == (repo_copy / report).read_bytes()
    stage = run([*DVC, "status", "demo_data"], clone, **base).stdout
    assert "Data and pipelines are up to date" in stage, stage
    dry = run([*DVC, "repro", "--dry", "demo_data"], clone, **base).stdout
    assert "Running stage" not in dry and "didn't change" in dry, dry
