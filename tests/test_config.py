import dataclasses
import re

import pytest

from longlive_core.config import ConfigError, from_mapping, load_params, stage_config
from longlive_core.data.demo import DemoDataConfig
from longlive_core.data.ingest import IngestConfig
from longlive_core.tracking.mlflow_run import TrackingConfig

from .conftest import REPO


@dataclasses.dataclass(frozen=True)
class Inner:
    a: int = 1


@dataclasses.dataclass(frozen=True)
class Outer:
    name: str
    ratio: float = 0.5
    items: list[str] = dataclasses.field(default_factory=list)
    inner: Inner = dataclasses.field(default_factory=Inner)
    maybe: str | None = None


def test_from_mapping_builds_nested_and_converts_ints_to_floats():
    cfg = from_mapping(Outer, {"name": "x", "ratio": 1, "items": ["a"], "inner": {"a": 3}}, "s")
    assert cfg == Outer("x", 1.0, ["a"], Inner(3))
    assert isinstance(cfg.ratio, float)


@pytest.mark.parametrize("data, message", [
    ({"name": "x", "ratoi": 1.0}, "s: unknown key(s) ['ratoi']"),
    ({}, "s.name is required"),
    ({"name": 3}, "s.name: expected a string"),
    ({"name": "x", "inner": {"a": "3"}}, "s.inner.a: expected an integer"),
    ({"name": "x", "inner": {"a": True}}, "s.inner.a: expected an integer"),
    ({"name": "x", "items": "abc"}, "s.items: expected a list"),
])
def test_from_mapping_names_the_bad_key(data, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        from_mapping(Outer, data, "s")


def test_committed_params_parse_for_every_stage():
    params = load_params(REPO / "params.yaml")
    assert stage_config(DemoDataConfig, "demo_data", params).enabled
    assert stage_config(IngestConfig, "ingest", params).source == "data/demo/raw"
    assert stage_config(TrackingConfig, "tracking", params).experiment == "longlive-pipeline"


def test_ingest_validation_errors():
    with pytest.raises(ConfigError, match="ingest.workers"):
        from_mapping(IngestConfig, {"source": "x", "workers": 0}, "ingest")
    with pytest.raises(ConfigError, match="start with a dot"):
        from_mapping(IngestConfig, {"source": "x", "extensions": ["mp4"]}, "ingest")


def test_the_training_stages_configs_import_nothing_heavy():
    """What validates params (flows, `longlive plan`, a launcher before torchrun) reads the configs
    without importing torch."""
    import subprocess
    import sys

    modules = ["longlive_core.train.config", "longlive_core.distill.config", "longlive_core.distributed.config",
               "longlive_core.infer.config", "longlive_core.quant.config"]
    code = (f"import sys\nfor m in {modules!r}: __import__(m)\n"
            "print(sorted(m for m in ('torch', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_shared_sections_sit_at_the_stages_level_in_params():
    """The parallel and checkpoint sections are typed objects of their own, their keys where they
    always were (train_ar.nproc, distill_dmd.checkpoint_every): flows and `longlive plan` read them."""
    from longlive_core.distill.config import DistillDMDConfig
    from longlive_core.train.config import TrainARConfig

    params = load_params(REPO / "params.yaml")
    for cls, stage in ((TrainARConfig, "train_ar"), (DistillDMDConfig, "distill_dmd")):
        cfg = stage_config(cls, stage, params)
        assert cfg.parallel.nproc == params[stage]["nproc"] and cfg.checkpoint.keep_runs == params[stage]["keep_runs"]
        with pytest.raises(ConfigError, match=rf"{stage}\.sp \(3\) must divide nproc \(2\)"):
            from_mapping(cls, {**params[stage], "nproc": 2, "sp": 3}, stage)
        with pytest.raises(ConfigError, match=rf"{stage}\.keep_runs must be at least 1"):
            from_mapping(cls, {**params[stage], "keep_runs": 0}, stage)
        with pytest.raises(ConfigError, match="unknown key"):
            from_mapping(cls, {**params[stage], "parallel": {"nproc": 2}}, stage)
