"""VBench's per-dimension results into its Quality, Semantic and Total scores (REFERENCE.md §5).

Official VBench writes, per run, a JSON object of ``dimension_name: [score, per-video results]``.
Each of its 16 dimensions is normalised with a fixed (min, max), (x - min) / (max - min), and
weighted (1, but 0.5 for dynamic degree); Quality is the weighted mean of the 7 quality dimensions,
Semantic that of the 9 semantic ones, Total = (4 Quality + Semantic) / 5. Unlike VBench's own
script, which scores a missing dimension as 0, a group with a missing dimension has no score here,
and neither has the Total: a partial set is reported as missing, never summed.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Dimension:
    low: float
    high: float
    weight: float
    group: str  # quality | semantic


QUALITY, SEMANTIC = "quality", "semantic"
DIMENSIONS = {  # VBench's normalisation range and weight of each dimension
    "subject_consistency": Dimension(0.1462, 1.0, 1.0, QUALITY),
    "background_consistency": Dimension(0.2615, 1.0, 1.0, QUALITY),
    "temporal_flickering": Dimension(0.6293, 1.0, 1.0, QUALITY),
    "motion_smoothness": Dimension(0.706, 0.9975, 1.0, QUALITY),
    "dynamic_degree": Dimension(0.0, 1.0, 0.5, QUALITY),
    "aesthetic_quality": Dimension(0.0, 1.0, 1.0, QUALITY),
    "imaging_quality": Dimension(0.0, 1.0, 1.0, QUALITY),
    "object_class": Dimension(0.0, 1.0, 1.0, SEMANTIC),
    "multiple_objects": Dimension(0.0, 1.0, 1.0, SEMANTIC),
    "human_action": Dimension(0.0, 1.0, 1.0, SEMANTIC),
    "color": Dimension(0.0, 1.0, 1.0, SEMANTIC),
    "spatial_relationship": Dimension(0.0, 1.0, 1.0, SEMANTIC),
    "scene": Dimension(0.0, 0.8222, 1.0, SEMANTIC),
    "appearance_style": Dimension(0.0009, 0.2855, 1.0, SEMANTIC),
    "temporal_style": Dimension(0.0, 0.364, 1.0, SEMANTIC),
    "overall_consistency": Dimension(0.0, 0.364, 1.0, SEMANTIC),
}
GROUP_WEIGHTS = {QUALITY: 4.0, SEMANTIC: 1.0}


class VBenchResultError(ValueError):
    """A results file that is not VBench's format; the message names the file and the key."""


def read_results(paths: list[Path]) -> dict[str, float]:
    """Every dimension's score from VBench's result files (``*_eval_results.json``); a dimension
    given twice with different scores is an error."""
    scores: dict[str, float] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise VBenchResultError(f"{path}: not readable as JSON ({e})") from None
        if not isinstance(data, dict):
            raise VBenchResultError(f"{path}: expected an object of dimension: [score, per-video results]")
        for key, value in data.items():
            name = key.replace(" ", "_")
            if name not in DIMENSIONS:
                raise VBenchResultError(f"{path}: {key!r} is not a VBench dimension")
            if not isinstance(value, list) or not value or isinstance(value[0], bool) \
                    or not isinstance(value[0], (int, float)):
                raise VBenchResultError(f"{path}: {key} is not [score, per-video results]")
            if name in scores and scores[name] != float(value[0]):
                raise VBenchResultError(f"{path}: {key} scored {value[0]} here and {scores[name]} in another file")
            scores[name] = float(value[0])
    return scores


def aggregate(scores: dict[str, float]) -> dict:
    """Normalised dimensions, Quality, Semantic and Total (None where a dimension is missing), and
    the missing dimensions by name."""
    unknown = sorted(set(scores) - set(DIMENSIONS))
    if unknown:
        raise VBenchResultError(f"not VBench dimensions: {unknown}")
    normalised = {name: (scores[name] - d.low) / (d.high - d.low) for name, d in DIMENSIONS.items() if name in scores}
    groups: dict[str, float | None] = {}
    for group in GROUP_WEIGHTS:
        members = {n: d for n, d in DIMENSIONS.items() if d.group == group}
        groups[group] = (sum(normalised[n] * d.weight for n, d in members.items()) / sum(d.weight for d in
                         members.values())) if set(members) <= set(normalised) else None
    total = None
    if all(v is not None for v in groups.values()):
        total = sum(GROUP_WEIGHTS[g] * v for g, v in groups.items()) / sum(GROUP_WEIGHTS.values())
    return {"normalised": normalised, "quality": groups[QUALITY], "semantic": groups[SEMANTIC], "total": total,
            "missing": sorted(set(DIMENSIONS) - set(scores))}
