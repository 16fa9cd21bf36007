"""The model-folder contract as a typed object: read back as written, older versions migrated, newer
ones and damaged files refused with the file and the field; and the identity a downstream stage keys
on: the weights and how they run, never the lineage."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from longlive_core.models.folder import (
    SCHEMA_VERSION,
    AdapterFolder,
    AdapterSettings,
    Sampling,
    as_json,
    read_adapter_folder,
    read_dit_folder,
    read_folder,
    write_config,
)
from longlive_core.models.identity import folder_identity, identity_digest, write_identity
from longlive_core.models.weights import CheckpointError

from .helpers.ar_model import folder_config


def test_a_folder_reads_back_as_written(tmp_path):
    config = folder_config(lineage={"git.commit": "abc"})
    written = write_config(config, tmp_path)
    assert written["schema_version"] == SCHEMA_VERSION
    assert read_dit_folder(tmp_path) == config
    assert read_dit_folder(tmp_path).dit_config.num_heads > 0
    adapter = AdapterFolder("peft-lora", "distill_dmd", "models/ar", AdapterSettings(4, 4.0), Sampling("few-step",
                            (1000, 0), window=6), {"steps": 2}, base_model_identity="0123")
    write_config(adapter, tmp_path / "dmd")
    assert read_adapter_folder(tmp_path / "dmd") == adapter
    with pytest.raises(CheckpointError, match="is a peft-lora folder"):
        read_dit_folder(tmp_path / "dmd")


def test_a_folder_of_the_first_version_is_read_through_its_migration(tmp_path):
    """What train_ar wrote before config.json had a version: no schema_version, no encoder digests."""
    old = as_json(folder_config())
    del old["schema_version"]
    old["vae"], old["text_encoder"] = {"path": "tiny", "seed": 0}, {"path": "tiny", "max_length": 16, "seed": 0}
    (tmp_path / "config.json").write_text(json.dumps(old))
    folder = read_dit_folder(tmp_path)
    assert folder.schema_version == SCHEMA_VERSION and folder.vae.sha256 is None
    assert folder.text_encoder.max_length == 16


def test_a_version_2_few_step_window_is_read_as_the_attention_it_ran(tmp_path):
    """Version 2 counted the cached frames only (a chunk read window + itself) and rolled out with no
    sinks: read as version 3, the window counts the chunk and the sinks are 0, the same attention."""
    old = as_json(dataclasses.replace(folder_config(), sampling=Sampling("few-step", (1000, 0), window=6,
                                                                          chunk_frames=2)))
    old["schema_version"] = 2
    for key in ("global_sink", "shot_sink"):
        del old["sampling"][key]
    folder = read_json_folder(old, tmp_path / "w4a4")
    assert (folder.sampling.window, folder.sampling.global_sink, folder.sampling.shot_sink) == (8, 0, 0)
    ar = as_json(folder_config())
    ar["schema_version"] = 2
    assert read_json_folder(ar, tmp_path / "ar").sampling == folder_config().sampling  # an AR one: as it was


def read_json_folder(raw: dict, directory):
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(raw))
    return read_dit_folder(directory)


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["latent"].pop("channels"), r"config\.json: config\.latent\.channels is required"),
    (lambda d: d["latent"].update(chunk_frames="8"), r"config\.latent\.chunk_frames: expected an integer"),
    (lambda d: d.update(surprise=1), r"unknown key\(s\) \['surprise'\]"),
    (lambda d: d.update(schema_version=SCHEMA_VERSION + 1), "newer than this code reads"),
    (lambda d: d.update(format="onnx"), "not a model folder this project runs"),
])
def test_a_missing_or_malformed_field_names_the_file_and_the_field(tmp_path, change, message):
    data = as_json(folder_config())
    change(data)
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=message) as caught:
        read_folder(tmp_path, "train_ar")
    assert str(tmp_path / "config.json") in str(caught.value)


def test_a_truncated_config_is_one_clear_error(tmp_path):
    text = json.dumps(as_json(folder_config()))
    (tmp_path / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(CheckpointError, match="is not readable JSON .*rerun train_ar"):
        read_folder(tmp_path, "train_ar")
    with pytest.raises(CheckpointError, match="is missing: run train_ar first"):
        read_folder(tmp_path / "nowhere", "train_ar")
    # a folder a user named (`longlive generate --model`): no stage to name, what a model folder is instead
    with pytest.raises(CheckpointError, match="nowhere is not a model folder .*give the folder that holds config.json"):
        read_folder(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="the folder is damaged; make it again, or copy the folder again"):
        read_folder(tmp_path)


def test_the_identity_is_the_weights_and_how_they_run_never_the_lineage(tmp_path):
    save_file({"w": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    config = as_json(folder_config(lineage={"git.commit": "a", "step_ranges": [[0, 4]]}))
    first = write_identity(tmp_path, config, tmp_path / "identity.json")
    again = as_json(folder_config(lineage={"git.commit": "b", "step_ranges": [[0, 4], [4, 4]]}))
    assert folder_identity(tmp_path, again) == first
    other_sampling = as_json(dataclasses.replace(folder_config(), sampling=Sampling("few-step", (1000, 0))))
    assert folder_identity(tmp_path, other_sampling) != first
    save_file({"w": torch.full((3,), 2.0)}, str(tmp_path / "model.safetensors"))
    assert folder_identity(tmp_path, config) != first
    assert len(identity_digest(tmp_path / "identity.json")) == 16
    with pytest.raises(CheckpointError, match="holds no safetensors weights"):
        folder_identity(tmp_path / "empty", config)
