"""The regression verdict: the candidate's scores against the registered champion's. It fails
closed: what cannot be checked fails, saying why.

- An absolute floor first, champion or not: the mean optical flow of the suite's videos
  (``motion``, px/frame at 128 px wide) at least ``evaluate.min_motion`` (a frozen video scores
  perfect flicker and consistency).
- The registry: "no champion" passes only when the registry was read and holds no ``champion``
  alias; tracking off or a read that failed fails the verdict.
- The champion's scores count only when made under the candidate's settings (``suite.settings``);
  otherwise the verdict fails saying which differ (``evaluate.rescore_champion`` scores the champion
  again under the candidate's settings before it comes to that).
- Every metric that either side has is compared (``METRICS``: its direction; margins absolute, in
  its unit, ``evaluate.margins`` merged over ``DEFAULT_MARGINS``); one that the other side lacks
  fails unless ``evaluate.optional_metrics`` names it.

It never fails the pipeline: ``package`` and the scheduled retraining act on it.
"""
from __future__ import annotations

import dataclasses

# name -> higher is better; and the default margin, in the metric's own unit
METRICS = {
    "temporal_flickering": (True, 0.01),  # VBench's, in [0, 1]
    "within_shot_consistency": (True, 0.05),  # colour-histogram intersection, in [0, 1]
    "shot_switch_accuracy": (True, 0.25),  # hits / (asked + unasked) cuts
    "imaging_quality": (True, 0.02),  # VBench's (MUSIQ / 100), in [0, 1]
    "subject_consistency": (True, 0.02),  # VBench's (DINO features), in [0, 1]
    "vbench_total": (True, 0.01),  # official VBench's Total (or Quality) score, in [0, 1]
    "dynamic_degree": (True, 0.1),  # official VBench's (RAFT): the share of videos it judges moving, in [0, 1]
    "fvd": (False, 25.0),  # Fréchet video distance to the reference set: lower is better
}
DEFAULT_MARGINS = {name: margin for name, (_, margin) in METRICS.items()}
SETTINGS_TAG = "evaluate.settings"  # the scores' settings (JSON) on evaluate's MLflow run and the registered one's


@dataclasses.dataclass(frozen=True)
class Champion:
    label: str  # "<registered model> v<version>"
    scores: dict[str, float]  # its suite aggregate
    settings: dict | None  # what those scores were made under (None: not recorded, an older champion)
    rescored: bool = False  # scored again here under the candidate's settings
    version: str | None = None  # its registry version: package promotes only over this one


@dataclasses.dataclass(frozen=True)
class RegistryRead:
    """What reading the registry found: ``failure`` says why it could not be read (None: read)."""

    champion: Champion | None = None
    failure: str | None = None


@dataclasses.dataclass(frozen=True)
class VerdictRules:
    registered_model: str
    margins: dict[str, float]  # merged over DEFAULT_MARGINS
    optional_metrics: tuple[str, ...] = ()
    min_motion: float = 0.0


def settings_differences(candidate: dict, champion: dict | None) -> list[str]:
    """The settings in which the champion's scores differ from the candidate's ("all" when unknown)."""
    if champion is None:
        return ["all (the champion's scores record none)"]
    return sorted(k for k in {*candidate, *champion} if candidate.get(k) != champion.get(k))


def needs_rescoring(scores: dict[str, float], settings: dict, champion: Champion, rules: VerdictRules) -> bool:
    """Whether the champion's recorded scores cannot be compared with these: other settings, or a
    metric the candidate has that the champion lacks (and that is not optional)."""
    lacking = {m for m in scores if m in METRICS and m not in champion.scores} - set(rules.optional_metrics)
    return bool(settings_differences(settings, champion.settings) or lacking)


def verdict(scores: dict[str, float], settings: dict, registry: RegistryRead, rules: VerdictRules) -> dict:
    reasons, passed = [], True
    motion = scores.get("motion")
    if motion is None or motion < rules.min_motion:
        passed = False
        reasons.append(f"motion: {'none measured' if motion is None else f'{motion:.4f} px/frame'} under the floor "
                       f"evaluate.min_motion {rules.min_motion}: a still video")
    else:
        reasons.append(f"motion: {motion:.4f} px/frame, over the floor {rules.min_motion}")
    if registry.failure is not None:
        reasons.append(f"the MLflow registry could not be read ({registry.failure}): no champion to compare "
                       "with, so nothing is promoted")
        return {"passed": False, "champion": None, "champion_version": None, "reasons": reasons}
    champion = registry.champion
    if champion is None:
        reasons.append(f"no champion registered as {rules.registered_model}: nothing to compare with")
        return {"passed": passed, "champion": None, "champion_version": None, "reasons": reasons}
    differ = settings_differences(settings, champion.settings)
    if differ:
        reasons.append(f"the champion's scores were made under other settings ({', '.join(differ)}): not "
                       "comparable; set evaluate.rescore_champion: true to score it under these")
        return {"passed": False, "champion": champion.label, "champion_version": champion.version,
                "reasons": reasons}
    for metric in sorted({*scores, *champion.scores} & set(METRICS)):
        higher, margin = METRICS[metric][0], rules.margins[metric]
        ours, theirs = scores.get(metric), champion.scores.get(metric)
        if ours is None or theirs is None:
            side = "the candidate" if ours is None else "the champion"
            if metric in rules.optional_metrics:
                reasons.append(f"{metric}: {side} has no score: not compared (evaluate.optional_metrics)")
                continue
            passed = False
            reasons.append(f"{metric}: {side} has no score: cannot be compared (name it in evaluate.optional_metrics "
                           "to allow that)")
            continue
        ok = ours >= theirs - margin if higher else ours <= theirs + margin
        passed &= ok
        reasons.append(f"{metric}: {ours:.4f} against the champion's {theirs:.4f} ({'higher' if higher else 'lower'} "
                       f"is better, margin {margin}): {'ok' if ok else 'worse'}")
    return {"passed": passed, "champion": champion.label + (" (rescored here)" if champion.rescored else ""),
            "champion_version": champion.version, "reasons": reasons}
