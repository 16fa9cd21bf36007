"""``longlive bundle``: what a deployer runs on a published model bundle.

    longlive bundle verify dist/                         # a folder
    longlive bundle verify s3://models/longlive-2.0/V/   # a published version, read back and hashed
    longlive bundle fetch s3://models/longlive-2.0/V/ DIR

S3 credentials come from the environment (or ``--profile``); ``--endpoint-url`` for MinIO, Ceph or
a local endpoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longlive_core.data.s3_mirror import S3Config, s3_client
from longlive_core.package.bundle import BundleError, fetch, verify_dir, verify_s3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive bundle", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    verify = sub.add_parser("verify", help="check every file of a bundle against its SHA256SUMS")
    verify.add_argument("bundle", help="a bundle folder or s3://bucket/prefix/VERSION/")
    get = sub.add_parser("fetch", help="download a published bundle, verified, into a new folder")
    get.add_argument("uri", help="s3://bucket/prefix/VERSION/")
    get.add_argument("dest", type=Path)
    for p in (verify, get):
        p.add_argument("--endpoint-url", help="S3 endpoint (MinIO, Ceph, a local one); default AWS")
        p.add_argument("--region")
        p.add_argument("--profile", help="an AWS profile name; default: credentials from the environment")
    args = ap.parse_args(argv)
    client = None
    try:
        source = args.bundle if args.cmd == "verify" else args.uri
        if source.startswith("s3://"):
            client = s3_client(S3Config(endpoint_url=args.endpoint_url, region=args.region, profile=args.profile))
        if args.cmd == "verify":
            version = verify_s3(client, source) if client else verify_dir(Path(source))
            print(f"{source}: bundle {version}, every file matches SHA256SUMS")
        else:
            if client is None:
                raise BundleError(f"{source} is not an s3:// URI: fetch downloads a published bundle")
            version = fetch(client, source, args.dest)
            print(f"{args.dest}: bundle {version}, fetched and verified")
    except BundleError as e:
        print(f"longlive bundle: {e}", file=sys.stderr)
        return 1
    return 0
