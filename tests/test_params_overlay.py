import re
import shutil
from collections.abc import Mapping

import pytest
import yaml
from ruamel.yaml import YAML

from longlive_core.caption.config import CaptionConfig
from longlive_core.config import load_params, stage_config
from longlive_core.data.assemble import AssembleConfig
from longlive_core.data.demo import DemoDataConfig
from longlive_core.data.ingest import IngestConfig
from longlive_core.iqa.metrics import IQAConfig
from longlive_core.latents.encode import EncodeLatentsConfig
from longlive_core.params_overlay import apply_overlay, leaf_keys, missing_keys
from longlive_core.params_overlay import main as params_main
from longlive_core.shots.detect import ShotsConfig
from longlive_core.tracking.mlflow_run import TrackingConfig

from .conftest import REPO

PRODUCTION = REPO / "configs/production.yaml"


def _flat(tree: Mapping, where: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        path = f"{where}.{key}" if where else key
        out.update(_flat(value, path) if isinstance(value, Mapping) else {path: value})
    return out


def _comments(path) -> dict[str, str]:
    """Every key's end-of-line comment, read with ruamel (not with the code under test)."""
    out: dict[str, str] = {}

    def walk(node, where):
        for key, value in node.items():
            p = f"{where}.{key}" if where else key
            token = node.ca.items.get(key, [None] * 4)[2]
            out[p] = token.value.partition("\n")[0].lstrip("# ").strip() if token else ""
            if isinstance(value, Mapping):
                walk(value, p)

    walk(YAML().load(path.read_text()), "")
    return out


def _header(text: str) -> list[str]:
    """The lines before the first key."""
    return text[:re.search(r"^\w", text, re.M).start()].splitlines()


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


@pytest.fixture
def production_params(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    changed = apply_overlay(params, PRODUCTION)
    assert "demo_data.enabled" in changed and "assemble.buckets" in changed
    return params


def test_production_values_and_comments_replace_the_defaults(production_params):
    text, overlay_text = production_params.read_text(), PRODUCTION.read_text()
    overlay = yaml.safe_load(overlay_text)
    got = _flat(load_params(production_params))
    assert {k: got[k] for k in _flat(overlay)} == _flat(overlay)
    assert got["ingest.s3.endpoint_url"] is None and got["assemble.buckets"][2]["max_s"] is None

    # every key the overlay sets has a comment, and it is the one params.yaml now shows
    overlay_comments, comments = _comments(PRODUCTION), _comments(production_params)
    uncommented = [k for k in leaf_keys(overlay) if not overlay_comments[k]]
    assert not uncommented, f"configs/production.yaml: give these keys a comment: {uncommented}"
    assert {k: comments[k] for k in overlay_comments} == overlay_comments

    # nothing left that speaks of the demo, unless the overlay's own comment does
    for line in text.splitlines():
        if "demo" in line.lower().replace("demo_data", ""):
            comment = line.partition("#")[2].strip()
            assert comment and comment in overlay_text, line

    # null stays null: an empty value is only ever a section
    assert re.search(r"^    endpoint_url: null\s", text, re.M)
    assert re.search(r'name: ">64s", min_s: 64.0, max_s: null,', text)
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if re.fullmatch(r"\s*[\w.-]+:\s*(#.*)?", line):
            following = next(later for later in lines[i + 1:] if later.strip())
            assert _indent(following) > _indent(line), f"an empty value: {line}"

    assert _header(text) == _header(overlay_text)


def test_apply_changes_only_values_and_comments(production_params):
    before, after = (REPO / "params.yaml").read_text(), production_params.read_text()

    def layout(text):  # each line's indentation and key or list dash, the header aside
        body = text[re.search(r"^\w", text, re.M).start():]
        return [re.match(r"\s*(- |[\w.-]+:)?", line).group(0) for line in body.splitlines()]

    assert layout(after) == layout(before)
    # a second apply changes nothing more
    assert apply_overlay(production_params, PRODUCTION) == []
    assert production_params.read_text() == after


def test_params_applied_to_itself_is_byte_identical(tmp_path):
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    assert apply_overlay(params, REPO / "params.yaml") == []
    assert params.read_bytes() == (REPO / "params.yaml").read_bytes()


def test_overlay_owns_the_comments_and_lists_it_names(tmp_path):
    params, overlay = tmp_path / "params.yaml", tmp_path / "overlay.yaml"
    params.write_text(
        "# old header\n\n"
        "a:\n"
        "  x: 1      # old comment, now false\n"
        "  y: null   # untouched\n"
        "  z: 2      # comment dropped with the old value\n"
        "  l:        # old list\n"
        "    - {n: 1}\n"
        "    - {n: 2}\n"
        "\n"
        "b: {}\n")
    overlay.write_text(
        "# new header\n"
        "a:\n"
        "    x: 3    # new comment\n"
        "    z: 2\n"
        "    l: [{n: 5}]   # new list\n")
    assert apply_overlay(params, overlay) == ["a.x", "a.l"]
    assert params.read_text() == (
        "# new header\n"
        "a:\n"
        "  x: 3    # new comment\n"
        "  y: null   # untouched\n"
        "  z: 2\n"
        "  l: [{n: 5}]   # new list\n"
        "\n"
        "b: {}\n")


def test_committed_production_overlay_gives_every_key_of_params():
    missing = missing_keys(REPO / "params.yaml", PRODUCTION)
    assert not missing, f"add these keys of params.yaml to configs/production.yaml, with a comment: {missing}"


def test_check_names_the_missing_keys(tmp_path, capsys):
    partial = tmp_path / "partial.yaml"
    partial.write_text(PRODUCTION.read_text().replace("    region: null", "    #", 1))  # ingest.s3.region only
    params = str(REPO / "params.yaml")
    assert params_main(["check", str(partial), "--params", params]) == 1
    assert "does not give 1 key(s)" in capsys.readouterr().err
    assert missing_keys(params, partial) == ["ingest.s3.region"]
    assert params_main(["check", str(PRODUCTION), "--params", params]) == 0


@pytest.mark.parametrize("overlay_text, message", [
    ("ingest:\n  min_duraton_s: 3\n", "ingest.min_duraton_s is not a key of params.yaml"),
    ("ingest:\n  s3: 3\n", "ingest.s3 is a section in params.yaml"),
    ("ingest:\n  workers:\n    a: 1\n", "ingest.workers is a single value in params.yaml"),
])
def test_overlay_with_a_typo_fails_and_leaves_params_untouched(tmp_path, capsys, overlay_text, message):
    params = tmp_path / "params.yaml"
    shutil.copy(REPO / "params.yaml", params)
    before = params.read_bytes()
    overlay = tmp_path / "bad.yaml"
    overlay.write_text(overlay_text)
    assert params_main(["apply", str(overlay), "--params", str(params)]) == 2
    assert message in capsys.readouterr().err
    assert params.read_bytes() == before


def test_every_stage_config_parses_after_apply(production_params, tmp_path, monkeypatch):
    prod = load_params(production_params)
    # validation wants the weights where the params say (MANIQA's file, the VAE's and umT5's
    # folders); empty ones stand in
    ckpt = tmp_path / prod["iqa_filter"]["maniqa_checkpoint"]
    ckpt.parent.mkdir(parents=True)
    ckpt.touch()
    for folder in [tmp_path / prod["encode_latents"][key] for key in ("vae", "text_encoder")] + [
            tmp_path / prod["caption"]["model"]]:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").touch()
    monkeypatch.chdir(tmp_path)
    assert stage_config(DemoDataConfig, "demo_data", prod).enabled is False
    assert stage_config(IngestConfig, "ingest", prod).min_duration_s == 16.0
    assert stage_config(ShotsConfig, "shots", prod).min_scene_len == 15
    assert stage_config(IQAConfig, "iqa_filter", prod).metric == "maniqa"
    assert stage_config(CaptionConfig, "caption", prod).max_new_tokens == 256
    assert [b.name for b in stage_config(AssembleConfig, "assemble", prod).buckets] == ["16-32s", "32-64s", ">64s"]
    assert stage_config(EncodeLatentsConfig, "encode_latents", prod).clip.width == 1280
    assert stage_config(TrackingConfig, "tracking", prod).enabled
