"""``longlive bundle``: what a deployer runs on a published model bundle.

    longlive bundle verify dist/                         # a folder: every file, then the bundled encoders
    longlive bundle verify s3://models/longlive-2.0/V/   # a published version, read back and hashed
    longlive bundle fetch s3://models/longlive-2.0/V/ DIR  # downloaded, verified as a folder is

A folder's bundled encoders (``package.include_encoders``) are checked against the digests in
``model/config.json``; their digests are memoised in the user's cache directory
(``$XDG_CACHE_HOME/longlive``), so ``longlive generate`` does not read them again.

S3 credentials come from the environment (or ``--profile``); ``--endpoint-url`` for MinIO, Ceph or
a local endpoint.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from longlive_core.data.s3_mirror import S3Config, s3_client
from longlive_core.package.bundle import BundleError, fetch, verify_dir, verify_s3
from longlive_core.package.encoders import verify_bundle_encoders


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
        if args.cmd == "verify" and client:
            version = verify_s3(client, source)
            print(f"{source}: bundle {version}, every file matches SHA256SUMS (the encoders' digests are checked "
                  "on a fetched copy: longlive bundle fetch)")
        elif args.cmd == "verify":
            version = verify_dir(Path(source))
            print(f"{source}: bundle {version}, every file matches SHA256SUMS; "
                  f"{verify_bundle_encoders(Path(source))}")
        else:
            if client is None:
                raise BundleError(f"{source} is not an s3:// URI: fetch downloads a published bundle")
            version = fetch(client, source, args.dest)
            # checked where it now lies, so the digests memoised are the ones `longlive generate` looks up
            print(f"{args.dest}: bundle {version}, fetched and verified; {verify_bundle_encoders(args.dest)}")
    except BundleError as e:
        print(f"longlive bundle: {e}", file=sys.stderr)
        return 1
    return 0
