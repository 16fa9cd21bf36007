"""Does MANIQA under bf16 autocast keep the fp32 scores, and so the keep decisions? Both precisions
score the same frames with the same crops (figures go into bench/RESULTS.md).

    python bench/iqa_agreement.py --checkpoint models/maniqa/ckpt_koniq10k.pt --frames-dir DIR \
        [--threshold 0.35] [--crops 20] [--device cuda]

DIR holds frames as images (PNG or JPEG; e.g. a few hundred frames sampled from real shots). Prints
the scores' Pearson and Spearman correlation, the largest and mean absolute difference, and how
many keep decisions at ``--threshold`` differ. Without the real KonIQ weights the answer means
nothing, so the checkpoint is required.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import cv2
import numpy as np
import pandas as pd
import torch

from longlive_core.config import from_mapping
from longlive_core.devices import pick_device
from longlive_core.iqa.metrics import IQAConfig, QualityMetric


def load_frames(folder: Path) -> np.ndarray:
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not paths:
        raise SystemExit(f"no PNG or JPEG frames in {folder}")
    frames = [cv2.cvtColor(cv2.imread(str(p)), cv2.COLOR_BGR2RGB) for p in paths]
    shape = frames[0].shape
    if any(f.shape != shape for f in frames):
        raise SystemExit(f"frames differ in size; resize them to one size first (the first is {shape})")
    return np.stack(frames)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", type=Path, required=True)
    ap.add_argument("--frames-dir", type=Path, required=True)
    ap.add_argument("--threshold", type=float, default=0.35)
    ap.add_argument("--crops", type=int, default=20)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--device", default="auto")
    args = ap.parse_args()
    frames = load_frames(args.frames_dir)
    device = pick_device(args.device, "--device")
    scores = {}
    for precision in ("fp32", "bf16"):
        cfg = from_mapping(IQAConfig, {"metric": "maniqa", "maniqa_checkpoint": str(args.checkpoint),
                                       "crops": args.crops, "batch_size": args.batch, "precision": precision},
                           "iqa")
        torch.manual_seed(0)  # the same random crops for both
        scores[precision] = QualityMetric(cfg, device)(frames)
    s = pd.DataFrame(scores)
    diff = (s["bf16"] - s["fp32"]).abs()
    flips = int(((s["fp32"] >= args.threshold) != (s["bf16"] >= args.threshold)).sum())
    print(f"{len(s)} frames, {args.crops} crops, threshold {args.threshold}")
    print(f"pearson {s['fp32'].corr(s['bf16']):.5f}  spearman {s['fp32'].corr(s['bf16'], method='spearman'):.5f}")
    print(f"|bf16 - fp32|: max {diff.max():.5f}, mean {diff.mean():.5f}")
    print(f"keep decisions that differ: {flips} of {len(s)}")


if __name__ == "__main__":
    main()
