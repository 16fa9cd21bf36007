"""Motion score of a shot: mean optical-flow magnitude (Farneback, OpenCV) between neighbouring
frames, on frames downscaled to a fixed width, in pixels per frame at that width. Static shots
score near 0; the paper's model is weak on dynamic degree, so curators may drop them."""
from __future__ import annotations

import cv2
import numpy as np


def _gray(frame: np.ndarray, width: int) -> np.ndarray:
    h, w = frame.shape[:2]
    size = (width, max(1, round(h * width / w)))
    return cv2.cvtColor(cv2.resize(frame, size, interpolation=cv2.INTER_AREA), cv2.COLOR_RGB2GRAY)


def flow_magnitude(a: np.ndarray, b: np.ndarray, width: int) -> float:
    flow = cv2.calcOpticalFlowFarneback(_gray(a, width), _gray(b, width), None, pyr_scale=0.5, levels=3,
                                        winsize=15, iterations=3, poly_n=5, poly_sigma=1.2, flags=0)
    return float(np.linalg.norm(flow, axis=2).mean())


def motion_score(pairs: list[tuple[np.ndarray, np.ndarray]], width: int) -> float:
    return float(np.mean([flow_magnitude(a, b, width) for a, b in pairs])) if pairs else 0.0
