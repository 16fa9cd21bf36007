"""`longlive-params apply OVERLAY`: merges an overlay (such as configs/production.yaml) into
params.yaml, so the switch is one command and shows in `git diff` and `dvc params diff` like any
other params change. The overlay owns what it names: each key it sets takes the overlay's lines
for it, value and end-of-line comment alike (so a comment written for other values never stays
beside new ones, and a list is replaced whole), and the overlay's header comment becomes the
file's. Every other line of params.yaml stays byte for byte as it was. Every key in the overlay
must already exist in params.yaml: a typo is an error, not a new, silently ignored key.

`longlive-params check OVERLAY` lists the keys of params.yaml that the overlay does not give, so
a key added to params.yaml cannot reach production with a value and comment meant for something
else."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from longlive_core.config import ConfigError, load_params
from longlive_core.io.atomic import write_bytes

# A line range [start, stop) of params.yaml and the lines that replace it.
Edit = tuple[int, int, list[str]]


class _Yaml:
    """A YAML file's lines, its values and its node tree (the nodes know their lines)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        text = self.path.read_text(encoding="utf-8")
        self.lines = text.splitlines(keepends=True)
        self.data = yaml.safe_load(text) or {}
        self.root = yaml.compose(text, Loader=yaml.SafeLoader) or yaml.MappingNode("tag:yaml.org,2002:map", [])
        if not isinstance(self.data, Mapping) or not isinstance(self.root, yaml.MappingNode):
            raise ConfigError(f"{path} must hold a mapping of stage names to their params")

    def header_stop(self) -> int:
        """The line of the first key: what comes before it is the header."""
        return self.root.value[0][0].start_mark.line if self.root.value else len(self.lines)

    def entry(self, start: int, stop: int, shift: int) -> list[str]:
        out = [_shift(line, shift) for line in self.lines[start:stop]]
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
        return out


def leaf_keys(tree: Mapping[str, Any], where: str = "") -> list[str]:
    """Dotted paths of every value that is not a section (a list is one value)."""
    keys: list[str] = []
    for key, value in tree.items():
        path = f"{where}.{key}" if where else str(key)
        keys += leaf_keys(value, path) if isinstance(value, Mapping) else [path]
    return keys


def missing_keys(params_path: str | Path, overlay_path: str | Path) -> list[str]:
    given = set(leaf_keys(_Yaml(overlay_path).data))
    return [key for key in leaf_keys(_Yaml(params_path).data) if key not in given]


def _shift(line: str, by: int) -> str:
    """Re-indents a line by ``by`` columns (the overlay may nest with another indent)."""
    if not line.strip():
        return line
    if by >= 0:
        return " " * by + line
    return line[min(-by, len(line) - len(line.lstrip(" "))):]


def _last_line(node: yaml.Node) -> int:
    """The last line of a value: the one that holds its end-of-line comment."""
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) and not node.flow_style and node.value:
        last = node.value[-1]
        return _last_line(last[1] if isinstance(last, tuple) else last)
    end = node.end_mark
    return end.line - 1 if end.column == 0 else end.line  # a block scalar ends at the next line's start


def _value(node: yaml.Node) -> Any:
    return yaml.SafeLoader("").construct_object(node, deep=True)


def _edits(base: yaml.MappingNode, over: yaml.MappingNode, overlay: _Yaml, where: str,
           changed: list[str]) -> list[Edit]:
    known = {key.value: (key, value) for key, value in base.value}
    edits: list[Edit] = []
    for key, value in over.value:
        path = f"{where}.{key.value}" if where else str(key.value)
        if key.value not in known:
            raise ConfigError(f"{path} is not a key of params.yaml (check the spelling)")
        base_key, base_value = known[key.value]
        section = isinstance(value, yaml.MappingNode)
        if section != isinstance(base_value, yaml.MappingNode):
            kind = "a section" if not section else "a single value"
            raise ConfigError(f"{path} is {kind} in params.yaml, and the overlay gives it otherwise")
        if section and (value.flow_style or base_value.flow_style):
            raise ConfigError(f"{path}: write the section in block style (one key a line) to overlay it")
        first, shift = key.start_mark.line, base_key.start_mark.column - key.start_mark.column
        last = first if section else _last_line(value)  # a section's own line holds its comment
        base_first = base_key.start_mark.line
        base_last = base_first if section else _last_line(base_value)
        edits.append((base_first, base_last + 1, overlay.entry(first, last + 1, shift)))
        if section:
            edits += _edits(base_value, value, overlay, path, changed)
        elif _value(base_value) != _value(value):
            changed.append(path)
    return edits


def _merged(base: Any, overlay: Any) -> Any:
    if not (isinstance(base, Mapping) and isinstance(overlay, Mapping)):
        return overlay
    return {**base, **{key: _merged(base.get(key), value) for key, value in overlay.items()}}


def overlaid_params(params_path: str | Path, overlay_path: str | Path) -> dict:
    """params.yaml with the overlay applied, read from a temporary copy (the file itself is untouched)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "params.yaml"
        copy.write_text(Path(params_path).read_text())
        apply_overlay(copy, overlay_path)
        return load_params(copy)


def apply_overlay(params_path: str | Path, overlay_path: str | Path) -> list[str]:
    """Merges the overlay into params.yaml (atomically); returns the dotted keys whose value changed."""
    params, overlay = _Yaml(params_path), _Yaml(overlay_path)
    changed: list[str] = []
    edits = _edits(params.root, overlay.root, overlay, "", changed)
    if any(line.lstrip().startswith("#") for line in overlay.lines[:overlay.header_stop()]):
        edits.append((0, params.header_stop(), overlay.entry(0, overlay.header_stop(), 0)))
    lines = list(params.lines)
    for start, stop, new in sorted(edits, reverse=True):
        lines[start:stop] = new
    text = "".join(lines)
    # The splice follows the files' layout; a layout it does not know must not pass unnoticed.
    if yaml.safe_load(text) != _merged(params.data, overlay.data):
        raise ConfigError(f"{overlay_path} could not be merged line by line into {params_path}: "
                          "write each value in the overlay on the lines of its key")
    write_bytes(text.encode("utf-8"), params_path)
    return changed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="longlive-params", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("apply", "merge an overlay into params.yaml"),
                        ("check", "list the keys of params.yaml that an overlay does not give")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("overlay")
        p.add_argument("--params", default="params.yaml")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "check":
            missing = missing_keys(args.params, args.overlay)
        else:
            changed = apply_overlay(args.params, args.overlay)
    except (ConfigError, OSError, yaml.YAMLError) as exc:
        print(f"longlive-params: {exc}", file=sys.stderr)
        return 2
    if args.cmd == "check":
        if missing:
            print(f"{args.overlay} does not give {len(missing)} key(s) of {args.params}: " + ", ".join(missing),
                  file=sys.stderr)
            return 1
        print(f"{args.overlay} gives every key of {args.params}")
        return 0
    print(f"{args.params}: {len(changed)} value(s) changed" + (": " + ", ".join(changed) if changed else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
