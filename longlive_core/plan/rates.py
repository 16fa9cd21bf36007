"""Measured per-unit rates (bench/rates.yaml): each names the bench/RESULTS.md row it comes from."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from longlive_core.config import ConfigError, from_mapping

DEFAULT_RATES = Path(__file__).resolve().parents[2] / "bench" / "rates.yaml"


@dataclass(frozen=True)
class Rate:
    stage: str
    device: str  # cpu | h200 | gb200 | ...
    value: float | None  # None: never measured
    unit: str
    devices: int = 1  # GPUs (or CPU cores) the measurement used
    variant: str = ""
    source: str = ""
    machine: str = ""
    date: str = ""
    command: str = ""
    commit: str = ""
    note: str = ""

    @property
    def per_device(self) -> float | None:
        return None if self.value is None else self.value / self.devices

    def cite(self) -> str:
        return f"bench/RESULTS.md \"{self.source}\", {self.machine}, {self.date}, {self.commit}"


def load_rates(path: str | Path = DEFAULT_RATES) -> list[Rate]:
    data = yaml.safe_load(Path(path).read_text()) or {}
    rates = [from_mapping(Rate, r, f"{path}: rates[{i}]") for i, r in enumerate(data.get("rates") or [])]
    for r in rates:
        if r.value is not None and (r.value <= 0 or not (r.source and r.date and r.machine)):
            raise ConfigError(f"{path}: the {r.stage} rate on {r.device} needs a positive value and its "
                              "source, machine and date")
    return rates


def find_rate(rates: list[Rate], stage: str, device: str, variant: str = "") -> Rate | None:
    """The rate for (stage, device, variant); a rate without a variant serves every variant."""
    for r in rates:
        if r.stage == stage and r.device == device and r.variant in ("", variant):
            return r
    return None
