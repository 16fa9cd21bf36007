"""The typed configuration of ``evaluate`` (``params.yaml``'s ``evaluate`` section)."""
from __future__ import annotations

import dataclasses

from longlive_core.config import ConfigError
from longlive_core.evaluate.vbench_run import VBenchConfig
from longlive_core.evaluate.verdict import DEFAULT_MARGINS, METRICS, VerdictRules
from longlive_core.evaluate.weighted import WeightPaths
from longlive_core.infer.prompts import PromptFileError, parse_prompts

VERDICT_METRICS = ("temporal_flickering", "within_shot_consistency", "shot_switch_accuracy")  # higher is better


@dataclasses.dataclass(frozen=True)
class EvaluateConfig:
    suite: dict = dataclasses.field(default_factory=dict)  # name -> a prompt file's text (longlive generate's)
    seed: int = 0
    steps: int | None = None  # sampling steps; null: the model folder's own (or generate.step_list)
    kv: str | None = None  # the KV cache's format; null: generate.kv
    cut_tolerance_frames: int = 6  # a detected cut this close to an asked one is a hit
    sheet_frames_per_shot: int = 4
    registered_model: str = "longlive-2.0"  # the MLflow registry name whose "champion" the verdict compares with
    margins: dict = dataclasses.field(default_factory=dict)  # merged over verdict.DEFAULT_MARGINS, per metric
    optional_metrics: tuple[str, ...] = ()  # compared when both sides have them; else not (by default it fails)
    min_motion: float = 0.0  # the suite's mean optical flow must reach this (px/frame at 128 px): never a still video
    rescore_champion: bool = False  # a champion scored under other settings is scored again under these
    weights: WeightPaths = WeightPaths()  # VBench's weighted dimensions from local checkpoints; null: skipped
    vbench: VBenchConfig = VBenchConfig()  # official VBench in its own environment; python null: not run
    device: str = "auto"

    def validate(self, where: str) -> None:
        if not self.suite:
            raise ConfigError(f"{where}.suite: give at least one prompt file (name: text)")
        for name, text in self.suite.items():
            if not isinstance(text, str) or not name.replace("_", "").replace("-", "").isalnum():
                raise ConfigError(f"{where}.suite.{name}: names are letters, digits, - and _; values prompt text")
            try:
                parse_prompts(text, 1.0, f"{where}.suite.{name}")
            except PromptFileError as e:
                raise ConfigError(str(e)) from None
        for key, names in (("margins", self.margins), ("optional_metrics", self.optional_metrics)):
            unknown = sorted(set(names) - set(METRICS))
            if unknown:
                raise ConfigError(f"{where}.{key}: unknown metric(s) {unknown}; known: {list(METRICS)}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 for v in self.margins.values()):
            raise ConfigError(f"{where}.margins: each margin is a number >= 0, in its metric's unit")
        if self.min_motion < 0:
            raise ConfigError(f"{where}.min_motion must be >= 0; got {self.min_motion}")
        self.weights.validate(f"{where}.weights")
        self.vbench.validate(f"{where}.vbench")
        if self.cut_tolerance_frames < 0 or self.sheet_frames_per_shot < 1:
            raise ConfigError(f"{where}: cut_tolerance_frames must be >= 0 and sheet_frames_per_shot >= 1")

    def verdict_rules(self) -> VerdictRules:
        return VerdictRules(self.registered_model, {**DEFAULT_MARGINS, **self.margins}, tuple(self.optional_metrics),
                            self.min_motion)
