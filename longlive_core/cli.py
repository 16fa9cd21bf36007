"""``longlive``: the project's one command, with subcommands.

    longlive generate --model DIR --prompts FILE --out FILE.mp4 ...   # a video from a model folder
    longlive bundle verify|fetch ...                                  # a model bundle, on disk or on S3
    longlive params apply|check OVERLAY                               # production values into params.yaml
    longlive plan --videos N --gpus K [--gpu h200|gb200]              # what a run costs, stage by stage

The pipeline's own commands stay where the layering puts them: ``longlive-flow`` (Prefect) and
``dvc repro``.
"""
from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "generate": ("longlive_core.infer.generate", "a video from a model folder and a prompt file"),
    "bundle": ("longlive_core.package.cli", "verify or fetch a model bundle (a folder or s3://...)"),
    "params": ("longlive_core.params_overlay", "merge or check a params overlay (configs/production.yaml)"),
    "plan": ("longlive_core.plan.cli", "hours and GPU-hours per stage for a run, from measured rates"),
}


def usage() -> str:
    lines = ["usage: longlive COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<10} {about}" for name, (_, about) in COMMANDS.items()]
    return "\n".join(lines + ["", "longlive COMMAND --help for a command's options"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] not in COMMANDS:
        print(f"longlive: unknown command {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
