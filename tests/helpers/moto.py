"""moto's standalone S3 server over real HTTP, for the tests that talk to S3."""
from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator

import boto3

from tests.conftest import VENV_BIN, free_port

KEY_ID, REGION = "testing-key-id", "us-east-1"


def s3(url: str, secret: str):
    return boto3.client("s3", endpoint_url=url, region_name=REGION, aws_access_key_id=KEY_ID,
                        aws_secret_access_key=secret)


@contextlib.contextmanager
def moto_server(secret: str) -> Iterator[str]:
    """Starts moto_server on a free port; yields its URL once it answers."""
    port = free_port()
    proc = subprocess.Popen([str(VENV_BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                s3(url, secret).list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)
