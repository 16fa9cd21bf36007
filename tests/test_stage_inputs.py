"""One definition of a stage's inputs: dvc.yaml lists exactly the code each stage runs, and the
reuse keys hash that same code, so what reruns a stage under DVC also redoes its cached work."""
import json
from pathlib import Path

import pytest
import yaml

from longlive_core.tracking import lineage
from longlive_core.tracking.lineage import code_closure

from .conftest import REPO

STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


def code_deps(stage: dict) -> set[Path]:
    """The project source files a stage's deps cover (a folder covers its .py files with code)."""
    out = set()
    for dep in stage.get("deps", []):
        path = REPO / str(dep)
        if not str(dep).startswith(("longlive_core", "tasks")):
            continue
        files = [path] if path.is_file() else sorted(path.rglob("*.py"))
        assert files, f"{dep} names no source file"
        out |= {f.relative_to(REPO) for f in files if lineage._has_code(f)}
    return out


@pytest.mark.parametrize("name", sorted(STAGES))
def test_dvc_yaml_lists_exactly_the_code_each_stage_runs(name):
    stage = STAGES[name]
    module = stage["cmd"].split("#")[0].split()[-1]
    assert stage["cmd"].startswith("python -m tasks."), stage["cmd"]
    runs, listed = set(code_closure(module)), code_deps(stage)
    assert not runs - listed, f"dvc.yaml's {name} misses code it runs: {sorted(map(str, runs - listed))}"
    assert not listed - runs, f"dvc.yaml's {name} lists code it never runs: {sorted(map(str, listed - runs))}"


def test_every_stage_module_is_in_dvc_yaml():
    modules = {p.stem for p in (REPO / "tasks").glob("*.py")} - {"__init__", "stage", "paths", "record_pipeline"}
    assert modules == set(STAGES)


def test_the_closure_follows_function_level_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "longlive_core"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text('"""only a docstring"""\n')
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("def f():\n    from . import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from longlive_core.sub.c import X\n")
    (pkg / "sub" / "c.py").write_text("X = 1\n")
    (pkg / "config.py").write_text("Y = 2\n")  # record keeping: never part of a closure
    (pkg / "sub" / "d.py").write_text("import longlive_core.config\n")
    monkeypatch.setattr(lineage, "REPO_ROOT", tmp_path)
    assert [p.as_posix() for p in code_closure("longlive_core.sub.a")] == [
        "longlive_core/sub/a.py", "longlive_core/sub/b.py", "longlive_core/sub/c.py"]
    assert [p.as_posix() for p in code_closure("longlive_core.sub.d")] == ["longlive_core/sub/d.py"]


def test_code_digest_sees_code_but_not_comments_or_docstrings(tmp_path, monkeypatch):
    (tmp_path / "longlive_core").mkdir()
    src = tmp_path / "longlive_core" / "m.py"
    monkeypatch.setattr(lineage, "REPO_ROOT", tmp_path)
    src.write_text('"""Doc."""\ndef f(x):\n    """What f does."""\n    return x + 1  # one more\n')
    first = lineage.code_digest("longlive_core.m")
    src.write_text('"""Another doc."""\n\n\ndef f(x):\n    return x + 1\n')
    assert lineage.code_digest("longlive_core.m") == first
    src.write_text('def f(x):\n    return x + 2\n')
    assert lineage.code_digest("longlive_core.m") != first


class _Run:
    def set_tags(self, tags):
        self.tags = tags


def test_the_weights_stage_sees_weights_replaced_at_the_same_path(tmp_path, monkeypatch):
    """DVC sees the weights through data/weights/<stage>.json: a new file there reruns the stage."""
    import os

    from longlive_core.config import load_params
    from tasks import weights

    monkeypatch.chdir(tmp_path)
    params = load_params(REPO / "params.yaml")
    ckpt = tmp_path / "maniqa.safetensors"
    ckpt.write_bytes(b"a" * 64)
    params["iqa_filter"].update(metric="maniqa", maniqa_checkpoint=str(ckpt))
    first = weights.body(weights.prepare(params), _Run())
    identity = (tmp_path / "data/weights/iqa_filter.json").read_bytes()
    assert first["files_changed"] == len(weights.WEIGHT_PARAMS)
    assert json.loads(identity)["weights"]["maniqa_checkpoint"]["path"] == str(ckpt)
    assert weights.body(weights.prepare(params), _Run())["files_changed"] == 0
    assert (tmp_path / "data/weights/iqa_filter.json").read_bytes() == identity  # DVC reruns nothing
    st = ckpt.stat()
    ckpt.write_bytes(b"b" * 64)  # other weights, same size, copied with the old times kept
    os.utime(ckpt, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert weights.body(weights.prepare(params), _Run())["files_changed"] == 1
    assert (tmp_path / "data/weights/iqa_filter.json").read_bytes() != identity
    for stage in weights.WEIGHT_PARAMS:  # the stages that read weights depend on their file
        assert f"data/weights/{stage}.json" in STAGES[stage]["deps"]
    # weights not there (a curation machine without the latent encoders) are recorded, not an error:
    # the stage that reads them says what is missing when it runs
    params["encode_latents"]["vae"] = str(tmp_path / "no-vae")
    assert weights.body(weights.prepare(params), _Run())["files_changed"] == 1
    vae = json.loads((tmp_path / "data/weights/encode_latents.json").read_text())["weights"]["vae"]
    assert vae == {"path": str(tmp_path / "no-vae"), "sha256": "missing"}
    # with generate.enhance, evaluate's videos depend on the enhancement model's weights too
    params["generate"].update(enhance=True, enhance_model=str(ckpt))
    assert weights.body(weights.prepare(params), _Run())["files_changed"] == 1
    read = json.loads((tmp_path / "data/weights/evaluate.json").read_text())["weights"]
    assert read["generate.enhance_model"]["path"] == str(ckpt)


@pytest.mark.parametrize("module", sorted(lineage.SPEED_ONLY))
def test_each_speed_only_module_names_the_test_that_shows_it_changes_no_number(module):
    path, name = lineage.SPEED_ONLY[module].split("::")
    assert f"def {name}(" in (REPO / path).read_text(), lineage.SPEED_ONLY[module]
    assert lineage._module_file(module) is not None


def test_a_speed_only_edit_changes_no_code_digest_and_a_numeric_edit_does(tmp_path, monkeypatch):
    pkg = tmp_path / "longlive_core"
    pkg.mkdir()
    (pkg / "trainer.py").write_text("from longlive_core import launch, maths\n")
    (pkg / "launch.py").write_text("FAST = True\n")
    (pkg / "maths.py").write_text("def f(x):\n    return 2 * x\n")
    monkeypatch.setattr(lineage, "REPO_ROOT", tmp_path)
    monkeypatch.setattr(lineage, "SPEED_ONLY", {"longlive_core.launch": "tests/x.py::test_x"})
    first = lineage.code_digest("longlive_core.trainer")
    (pkg / "launch.py").write_text("FAST = False\n")
    assert lineage.code_digest("longlive_core.trainer") == first
    (pkg / "maths.py").write_text("def f(x):\n    return 3 * x\n")
    assert lineage.code_digest("longlive_core.trainer") != first


def test_the_training_digests_cover_the_trainers_code_less_the_speed_only_modules():
    for trainer in ("longlive_core.train.trainer", "longlive_core.distill.trainer"):
        files = {p.as_posix() for p in code_closure(trainer)}
        assert "longlive_core/train/loop.py" in files and "longlive_core/quant/linear.py" in files
        assert not {"longlive_core/quant/triton_launch.py", "longlive_core/train/checkpointing.py"} & files


def test_train_ars_run_digest_sees_the_sample_weights_and_numeric_code_only(tmp_path, monkeypatch):
    """A bucket weight changes what is drawn: a new run digest; another column of samples.parquet does
    not. An edit of training's maths is a new digest; an edit of a speed-only module is not."""
    import shutil

    import pandas as pd

    from longlive_core.train.config import TrainARConfig
    from tasks import train_ar

    from .helpers.latent_cache import SMALL, make_cache

    latents = make_cache(tmp_path / "data/latents", SMALL)
    (tmp_path / "data/samples").mkdir(parents=True)
    shutil.move(latents / "samples.parquet", tmp_path / "data/samples/samples.parquet")
    for package in ("longlive_core", "tasks"):
        shutil.copytree(REPO / package, tmp_path / "code" / package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(lineage, "REPO_ROOT", tmp_path / "code")
    monkeypatch.chdir(tmp_path)
    cfg = TrainARConfig()
    base = train_ar.digest_components(cfg)
    samples = tmp_path / "data/samples/samples.parquet"
    df = pd.read_parquet(samples)
    df.assign(note="a column training never reads").to_parquet(samples, index=False)
    assert train_ar.digest_components(cfg) == base
    df.assign(sample_weight=[2.0] + [1.0] * (len(df) - 1)).to_parquet(samples, index=False)
    changed = train_ar.digest_components(cfg)
    assert {k for k in base if base[k] != changed[k]} == {"sample_weights"}
    df.to_parquet(samples, index=False)
    launch = tmp_path / "code/longlive_core/quant/triton_launch.py"
    launch.write_text(launch.read_text() + "\nFASTER = True\n")
    assert train_ar.digest_components(cfg) == base
    flow = tmp_path / "code/longlive_core/train/flow.py"
    flow.write_text(flow.read_text() + "\nSHIFT_FLOOR = 1e-3\n")
    assert {k for k, v in train_ar.digest_components(cfg).items() if base[k] != v} == {"code"}


def test_no_code_imports_a_name_from_a_lazy_package_root():
    """longlive_core.quant's root hands out its names lazily, which the closure cannot follow: the
    project's code imports its modules instead (``from longlive_core.quant import triton_kernels``)."""
    import ast

    for path in [*(REPO / "longlive_core").rglob("*.py"), *(REPO / "tasks").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module == "longlive_core.quant":
                for alias in node.names:
                    assert lineage._module_file(f"longlive_core.quant.{alias.name}"), (path, alias.name)


# The code digests in the curation stages' reuse keys: a change to any module they run re-splits every
# video, re-probes every file, re-scores every shot or re-encodes every latent of a production
# collection (~1,400 GPU-hours for the latents alone at 120K videos: `longlive plan`). Pinned, so such
# a change is made on purpose: if one fails, either keep that code as it was (an unrelated helper moved
# out of the closure, say) or, when the change is meant to redo the work, update its digest here.
REUSE_KEY_DIGESTS = {
    "longlive_core.latents.encode": "349e287242a6add6a5bb1c1ca1bab43f45f403f1c7beca626f5a2796113ec2cb",
    "longlive_core.shots.split": "36b0d4c6f73ddb6c5fcaa4f02e02818044c878e68587e66c22d5569d4ba6d74f",
    "longlive_core.video.probe": "f7c03b7a07b579cf9cd03a3b6fb94a4223e1fdbae7b1146d587bb1e4bc64bd9d",
    "longlive_core.iqa.score": "9e3a54978acf2143cd402273692520e00137d01f36dd5fe1b62b29e931457f9c",
}


@pytest.mark.parametrize("module", sorted(REUSE_KEY_DIGESTS))
def test_a_reuse_keys_code_changes_only_on_purpose(module):
    assert lineage.code_digest(module) == REUSE_KEY_DIGESTS[module], (
        f"the code {module} runs changed: every cached result keyed on it is redone in production. "
        f"Files: {[str(p) for p in code_closure(module)]}")
