"""Still images the reports show: PNG files written whole, and labelled strips of thumbnails."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from longlive_core.io.atomic import write_bytes


def write_png(path: Path, rgb: np.ndarray) -> None:
    ok, buf = cv2.imencode(".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    if not ok:
        raise RuntimeError(f"could not encode {path.name}")
    write_bytes(buf.tobytes(), path)


def labelled_strip(frames: list[np.ndarray], label: str, thumb_w: int = 160) -> np.ndarray:
    """The frames side by side, ``thumb_w`` wide each, under a one-line label (RGB uint8)."""
    h = max(1, round(frames[0].shape[0] * thumb_w / frames[0].shape[1]))
    strip = np.concatenate([cv2.resize(f, (thumb_w, h), interpolation=cv2.INTER_AREA) for f in frames], axis=1)
    band = np.full((18, strip.shape[1], 3), 255, np.uint8)
    cv2.putText(band, label.encode("ascii", "replace").decode(), (4, 13), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (0, 0, 0),
                1, cv2.LINE_AA)
    return np.concatenate([band, strip], axis=0)


def stack_rows(rows: list[np.ndarray], empty_width: int = 640) -> np.ndarray:
    """Rows of different widths one under the other, padded white on the right."""
    if not rows:
        return np.full((24, empty_width, 3), 255, np.uint8)
    width = max(x.shape[1] for x in rows)
    return np.concatenate([np.pad(x, ((0, 2), (0, width - x.shape[1]), (0, 0)), constant_values=255) for x in rows],
                          axis=0)
