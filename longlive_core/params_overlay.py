"""`longlive-params apply OVERLAY`: merges an overlay (such as configs/production.yaml) into
params.yaml, keeping its comments, so the switch is one command and shows in `git diff` and
`dvc params diff` like any other params change. Every key in the overlay must already exist in
params.yaml: a typo is an error, not a new, silently ignored key."""
from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from longlive_core.config import ConfigError
from longlive_core.io.atomic import write_bytes


def _merge(base: Any, overlay: Mapping[str, Any], where: str, changed: list[str]) -> None:
    for key, value in overlay.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in base:
            raise ConfigError(f"{path} is not a key of params.yaml (check the spelling)")
        if isinstance(value, Mapping):
            if not isinstance(base[key], Mapping):
                raise ConfigError(f"{path} is a single value in params.yaml, not a section")
            _merge(base[key], value, path, changed)
        elif base[key] != value:
            base[key] = value
            changed.append(path)


def apply_overlay(params_path: str | Path, overlay_path: str | Path) -> list[str]:
    yaml = YAML()
    yaml.preserve_quotes = True
    params = yaml.load(Path(params_path).read_text(encoding="utf-8"))
    overlay = YAML(typ="safe").load(Path(overlay_path).read_text(encoding="utf-8")) or {}
    changed: list[str] = []
    _merge(params, overlay, "", changed)
    buf = io.StringIO()
    yaml.dump(params, buf)
    write_bytes(buf.getvalue().encode("utf-8"), params_path)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive-params", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("apply", help="merge an overlay into params.yaml")
    a.add_argument("overlay")
    a.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    try:
        changed = apply_overlay(args.params, args.overlay)
    except (ConfigError, OSError) as exc:
        print(f"longlive-params: {exc}", file=sys.stderr)
        return 2
    print(f"{args.params}: {len(changed)} value(s) changed" + (": " + ", ".join(changed) if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
