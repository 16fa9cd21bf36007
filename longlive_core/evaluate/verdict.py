"""The regression verdict: the candidate's scores against the registered champion's.

A metric fails when the candidate is lower than the champion's by more than its margin (every
verdict metric is higher-is-better). With no champion the verdict passes and says why; it never
fails the pipeline: ``package`` and the scheduled retraining act on it.
"""
from __future__ import annotations


def verdict(scores: dict[str, float], champion: dict[str, float] | None, margins: dict[str, float],
            champion_label: str, no_champion_reason: str) -> dict:
    if champion is None:
        return {"passed": True, "champion": None, "reasons": [f"{no_champion_reason}: nothing to compare with"]}
    reasons, passed = [], True
    for metric, margin in sorted(margins.items()):
        if metric not in champion:
            reasons.append(f"{metric}: the champion has no score: not compared")
            continue
        ours, theirs = scores[metric], champion[metric]
        ok = ours >= theirs - margin
        passed &= ok
        reasons.append(f"{metric}: {ours:.4f} against the champion's {theirs:.4f} (margin {margin}): "
                       f"{'ok' if ok else 'worse'}")
    return {"passed": passed, "champion": champion_label, "reasons": reasons}
