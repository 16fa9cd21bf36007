"""The curation report: what curators look at to tune the thresholds.

Writes, into one directory: histograms of shot length, quality score and motion score with the
thresholds drawn in; counts per reject reason and per bucket (counts.json); contact sheets (a few
frames of each shot) of the best, the borderline and the rejected shots; the near-duplicate groups
(near_duplicates.csv, one row per member, and a contact sheet of the first groups); the captions'
sources and density (tokens per second of video, distinct noun phrases per caption); and index.md
tying them together.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pandas as pd

from longlive_core.io.atomic import atomic_path, write_bytes, write_json
from longlive_core.shots.clips import clip_frames_at, read_clip
from longlive_core.video.images import labelled_strip, stack_rows, write_png


@dataclasses.dataclass(frozen=True)
class ReportInputs:
    scores: pd.DataFrame  # iqa_filter output: usable shots with scores and kept
    rejected_shots: pd.DataFrame  # shots stage: too short and failed videos
    samples: pd.DataFrame
    clips_dir: Path
    min_shot_s: float
    max_shot_s: float
    metric: str
    threshold: float
    lower_better: bool
    min_motion: float
    dedup_hamming: int | None  # None: near-duplicates were not looked for
    captions: pd.DataFrame | None = None  # the caption stage's table (caption/run.py CAPTION_COLUMNS)


def _histogram(path: Path, values, title: str, xlabel: str, lines: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.hist(np.asarray(values, dtype=float), bins=30, color="#4c72b0")
    for label, x in lines.items():
        ax.axvline(x, color="#c44e52", linestyle="--")
        ax.text(x, ax.get_ylim()[1] * 0.95, f" {label}", color="#c44e52", va="top", fontsize=8)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("shots")
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


def contact_sheet(rows: pd.DataFrame, clips_dir: Path, frames_per_shot: int = 4, thumb_w: int = 160) -> np.ndarray:
    """One row of thumbnails per shot, labelled with its path, index and scores (RGB uint8)."""
    lines = []
    for r in rows.itertuples(index=False):
        at = [int(i) for i in np.linspace(0, r.num_frames - 1, frames_per_shot)]
        frames = clip_frames_at(read_clip(clips_dir, r.clip_shard, r.clip_member), at)
        verdict = "kept" if r.kept else "rejected"
        score = "unscorable" if pd.isna(r.iqa_score) else f"{r.iqa_score:.3f}"
        text = f"{r.path} #{r.shot_index}  {r.iqa_metric}={score}  motion={r.motion_score:.2f}  {verdict}"
        lines.append(labelled_strip([frames[i] for i in at], text, thumb_w))
    return stack_rows(lines, thumb_w * frames_per_shot)


def write_curation_report(inp: ReportInputs, out_dir: Path, per_sheet: int = 6) -> dict:
    out_dir.mkdir(parents=True, exist_ok=True)
    s = inp.scores
    lengths = pd.concat([s["duration_s"], inp.rejected_shots["duration_s"].dropna()])
    _histogram(out_dir / "shot_length.png", lengths, "Shot length (usable and too short)", "seconds",
               {"min": inp.min_shot_s, "max": inp.max_shot_s})
    direction = "lower is better" if inp.lower_better else "higher is better"
    _histogram(out_dir / "iqa_score.png", s["iqa_score"].dropna(), f"{inp.metric} ({direction})", inp.metric,
               {"threshold": inp.threshold})
    _histogram(out_dir / "motion_score.png", s["motion_score"], "Motion (mean optical flow)", "pixels per frame",
               {"min": inp.min_motion} if inp.min_motion > 0 else {})

    reasons: dict[str, int] = {}
    for reason in inp.rejected_shots["reason"]:
        key = "failed video" if reason.startswith("failed:") else reason.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    for reason in s.loc[~s["kept"], "reject_reason"]:
        key = reason.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    duplicates = s[s["dup_group"] >= 0].sort_values(["dup_group", "kept", "path", "shot_index"],
                                                    ascending=[True, False, True, True])
    counts = {"usable_shots": len(s), "kept_shots": int(s["kept"].sum()), "reject_reasons": reasons,
              "unscorable_frames": int(s["iqa_unscorable"].sum()),
              "near_duplicate_groups": int(duplicates["dup_group"].nunique()),
              "near_duplicate_shots": len(duplicates),
              "buckets": {str(k): int(v) for k, v in inp.samples["bucket"].value_counts().sort_index().items()},
              "samples": len(inp.samples), "captions": caption_counts(inp.captions)}
    write_json(counts, out_dir / "counts.json")
    write_bytes(duplicates[["dup_group", "path", "shot_index", "iqa_score", "kept", "reject_reason"]]
                .to_csv(index=False).encode("utf-8"), out_dir / "near_duplicates.csv")

    better_first = s.sort_values("iqa_score", ascending=inp.lower_better)
    best = better_first[better_first["kept"]].head(per_sheet)
    border = s.assign(gap=(s["iqa_score"] - inp.threshold).abs()).sort_values("gap").head(per_sheet)
    rejected = better_first[~better_first["kept"]].tail(per_sheet)
    first_groups = duplicates[duplicates["dup_group"].isin(duplicates["dup_group"].unique()[:per_sheet // 2])]
    sheets = {"contact_best.png": best, "contact_borderline.png": border, "contact_rejected.png": rejected,
              "contact_duplicates.png": first_groups}
    for name, rows in sheets.items():
        write_png(out_dir / name, contact_sheet(rows, inp.clips_dir))

    lines = ["# Curation report", "",
             f"{counts['kept_shots']} of {counts['usable_shots']} usable shots kept; {counts['samples']} samples.", "",
             "| reject reason | shots |", "|---|---|", *[f"| {k} | {v} |" for k, v in sorted(reasons.items())], "",
             "| bucket | samples |", "|---|---|", *[f"| {k} | {v} |" for k, v in counts["buckets"].items()], "",
             "![shot length](shot_length.png) ![quality](iqa_score.png) ![motion](motion_score.png)", "",
             f"{counts['unscorable_frames']} sampled frames could not be scored by {inp.metric} (uniform, such as "
             "black ones in fades) and were left out of their shots' scores.", "",
             *_duplicate_lines(duplicates, inp.dedup_hamming), *_caption_lines(counts["captions"]),
             "Best kept shots:", "", "![best](contact_best.png)", "",
             f"Borderline (nearest the {inp.metric} threshold {inp.threshold}):", "",
             "![borderline](contact_borderline.png)", "", "Rejected:", "", "![rejected](contact_rejected.png)", ""]
    write_bytes("\n".join(lines).encode("utf-8"), out_dir / "index.md")
    return counts


def _duplicate_lines(duplicates: pd.DataFrame, hamming: int | None, listed: int = 20) -> list[str]:
    if hamming is None:
        return ["Near-duplicate shots were not looked for (iqa_filter.dedup_hamming: null).", ""]
    groups = list(duplicates.groupby("dup_group", sort=True))
    lines = [f"{len(groups)} groups of near-duplicate shots across videos (each of 3 frame hashes within {hamming} "
             f"bits); {int((~duplicates['kept']).sum())} copies removed. All in near_duplicates.csv"
             + (f"; the first {listed}:" if len(groups) > listed else ":"), ""]
    if not groups:
        return lines
    lines += ["| group | kept | removed |", "|---|---|---|"]
    for number, rows in groups[:listed]:
        kept = ", ".join(f"{r.path} #{r.shot_index}" for r in rows[rows["kept"]].itertuples())
        removed = ", ".join(f"{r.path} #{r.shot_index}" for r in rows[~rows["kept"]].itertuples())
        lines.append(f"| {number} | {kept} | {removed} |")
    return [*lines, "", "![near-duplicates](contact_duplicates.png)", ""]


def caption_counts(captions: pd.DataFrame | None) -> dict:
    """Where the kept shots' captions came from, and their density: the model's tokens per second of video
    (model captions) and distinct noun phrases per caption (caption/text.py's heuristic, every caption)."""
    if captions is None or not len(captions):
        return {"shots": 0}
    model = captions[captions["caption_source"] == "model"]
    has = captions[captions["caption"].notna()]
    return {"shots": len(captions), "sidecar": int((captions["caption_source"] == "sidecar").sum()),
            "model": len(model), "failed": int((captions["fail_reason"] != "").sum()),
            "truncated": int(model["truncated"].sum()), "without_caption": int(captions["caption"].isna().sum()),
            "tokens_per_s_mean": float(model["tokens_per_s"].mean()) if len(model) else 0.0,
            "noun_phrases_mean": float(has["noun_phrases"].mean()) if len(has) else 0.0}


def _caption_lines(c: dict) -> list[str]:
    if not c.get("shots"):
        return []
    return [f"Captions of the {c['shots']} kept shots: {c['sidecar']} from sidecars, {c['model']} from the caption "
            f"model ({c['truncated']} cut at the token bound), {c['failed']} failed, {c['without_caption']} without "
            f"one. Density: {c['tokens_per_s_mean']:.1f} model tokens per second of video, "
            f"{c['noun_phrases_mean']:.2f} distinct noun phrases per caption.", ""]
