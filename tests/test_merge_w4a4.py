"""The W4A4 merge in the core, on a tiny AR model and an adapter made here: calibration and
evaluation on disjoint (sample, chunk) pairs, the errors it reports, and a merge over
max_rel_error that fails and leaves the folder as it was."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from longlive_core.distill.config import MergeW4A4Config
from longlive_core.distill.lora import LORA_TARGETS, lora_config
from longlive_core.distill.merge import MergeError, merge_inputs, merge_w4a4
from longlive_core.infer.enhance import ExampleBank
from longlive_core.models.checkpoint import load_dit
from longlive_core.models.config import DIT_CONFIGS
from longlive_core.models.folder import AdapterFolder, AdapterSettings, Sampling, read_dit_folder, write_config

from .helpers.ar_model import folder_config, make_ar_model
from .helpers.latent_cache import SMALL, TEXT_DIM, make_cache

STEPS = (1000, 946, 854, 681, 0)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    from peft import get_peft_model

    tmp = tmp_path_factory.mktemp("merge")
    ar = make_ar_model(tmp / "ar", chunk_frames=2)
    peft = get_peft_model(load_dit(ar, DIT_CONFIGS["tiny"], dtype=torch.float32), lora_config(4, 4.0))
    torch.manual_seed(3)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)  # a trained-looking adapter (peft starts B at zero)
    peft.save_pretrained(str(tmp / "dmd"))
    write_config(AdapterFolder("peft-lora", "distill_dmd", str(ar), AdapterSettings(4, 4.0, 0.0, LORA_TARGETS),
                               Sampling("few-step", STEPS, window=6, chunk_frames=2), {"recipe": "nvfp4"}),
                 tmp / "dmd")
    return tmp, ar, tmp / "dmd", make_cache(tmp / "latents", SMALL)


def test_calibration_and_evaluation_read_disjoint_chunks_and_say_when_few(inputs):
    _, _, _, latents = inputs
    calibration, evaluation, note = merge_inputs(latents, 2, 8, list(STEPS), 3, 2, 0)
    assert len(calibration) == 3 and len(evaluation) == 2 and "disjoint" in note
    assert not {i.key for i in calibration} & {i.key for i in evaluation}
    many_c, many_e, note = merge_inputs(latents, 2, 8, list(STEPS), 50, 50, 0)  # the val split has 7 chunks
    assert (len(many_c), len(many_e)) == (4, 3) and "only 7 (sample, chunk) pairs" in note
    assert not {i.key for i in many_c} & {i.key for i in many_e}


def test_the_merge_reports_its_errors_and_over_the_bound_fails_leaving_the_folder(inputs):
    tmp, ar, dmd, latents = inputs
    out = tmp / "w4a4"
    cfg = MergeW4A4Config(calibration_inputs=3, eval_inputs=3, device="cpu")

    def folder(quantization):
        return dataclasses.replace(folder_config(), format="longlive-w4a4", stage="merge_w4a4", **quantization)

    metrics = merge_w4a4(ar, dmd, latents, cfg, out, folder, torch.device("cpu"))
    assert 0 < metrics["rel_error_w4a4_vs_bf16"] < cfg.max_rel_error
    assert 0 < metrics["rel_error_w4a4_vs_distilled"] < 0.5 and metrics["packed_layers"] == 20
    written = (out / "model.safetensors").read_bytes()
    assert read_dit_folder(out).format == "longlive-w4a4"
    bank = ExampleBank.load(out)  # the train captions, for the bundle copied from the folder
    assert bank.captions == ("caption 0", "caption 1", "caption 2") and metrics["example_captions"] == 3
    assert bank.embeddings.shape == (3, TEXT_DIM)
    with pytest.raises(MergeError, match=r"over merge_w4a4.max_rel_error 1e-06: .* keeps the model it held"):
        merge_w4a4(ar, dmd, latents, dataclasses.replace(cfg, max_rel_error=1e-6, seed=1), out, folder,
                   torch.device("cpu"))
    assert (out / "model.safetensors").read_bytes() == written and not list(tmp.glob(".tmp-w4a4*"))


def test_each_input_runs_after_its_samples_earlier_chunks_in_the_kv_cache(inputs):
    """As generation runs a chunk: after its sample's earlier chunks written into the KV cache, within
    the adapter's window (a window of two chunks drops the oldest, which changes the prediction)."""
    from longlive_core.distill.merge import outputs
    from longlive_core.infer.config import RolloutConfig

    _, ar, _, latents = inputs
    calibration, evaluation, _ = merge_inputs(latents, 2, 8, list(STEPS), 50, 50, 0)
    every = calibration + evaluation
    assert all(len(i.context) == i.key[1] for i in every)
    deep = next(i for i in every if len(i.context) >= 2)
    model = load_dit(ar, DIT_CONFIGS["tiny"], dtype=torch.float32).eval()
    cpu = torch.device("cpu")
    whole = RolloutConfig(2, STEPS, None)
    with_context = outputs(model, [deep], torch.float32, cpu, whole)
    alone = outputs(model, [dataclasses.replace(deep, context=())], torch.float32, cpu, whole)
    assert not torch.allclose(with_context, alone)
    assert not torch.allclose(outputs(model, [deep], torch.float32, cpu, RolloutConfig(2, STEPS, 4)), with_context)
    torch.testing.assert_close(outputs(model, [deep], torch.float32, cpu, RolloutConfig(2, STEPS, 2 * len(every))),
                               with_context, rtol=0, atol=0)  # a window wider than the sample: all of it
