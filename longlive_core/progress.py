"""Progress lines for long work and the one-line summary a stage ends with.

Plain log lines rather than a redrawn bar: DVC, Prefect and Slurm all capture stderr to files,
where a bar turns into noise.
"""
from __future__ import annotations

import atexit
import gc
import logging
import sys
import time


class _CurrentStderr(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of each record, not the one it was made with: a
    process that swaps stderr (pytest's capture, a Prefect run) must never leave it a closed stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_freeze_registered = False


def freeze_at_exit() -> None:
    """At this process's exit, Python's finalization does not search what is still alive for
    reference cycles: module by module that took about 3 s for a stage's heap (torch, MLflow,
    pandas) at the end of every run, and the memory goes back to the system anyway. Exit handlers
    and weakref finalizers still run, and what reference counts free is still finalized. Once a
    process (``setup_logging`` calls it: every stage and command sets up its logging first)."""
    global _freeze_registered
    if not _freeze_registered:
        atexit.register(gc.freeze)
        _freeze_registered = True


def setup_logging(level: int = logging.INFO) -> None:
    freeze_at_exit()
    root = logging.getLogger()
    if not any(getattr(h, "_longlive", False) for h in root.handlers):
        handler = _CurrentStderr()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
        handler._longlive = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    root.setLevel(level)
    # Third-party libraries log every request at INFO; keep the stage's own lines readable.
    for noisy in ("botocore", "boto3", "urllib3", "s3transfer", "alembic", "mlflow", "pyscenedetect"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # diffusers imports bitsandbytes, which warns on every CPU import that an optional kernel is absent
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)


class Progress:
    """Logs ``done/total``, rate and ETA at most every ``every_s`` seconds."""

    def __init__(self, log: logging.Logger, label: str, total: int, unit: str = "items", every_s: float = 5.0):
        self.log, self.label, self.total, self.unit, self.every_s = log, label, total, unit, every_s
        self.done = 0
        self.start = time.monotonic()
        self._last = self.start

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done == self.total:
            self._last = now
            elapsed = max(now - self.start, 1e-9)
            rate = self.done / elapsed
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            pct = 100.0 * self.done / self.total if self.total else 100.0
            self.log.info("%s: %d/%d %s (%.0f%%), %.1f %s/s, ETA %.0fs",
                          self.label, self.done, self.total, self.unit, pct, rate, self.unit, eta)

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self.start
