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
