"""The bundle's model card (README.md): what it is, how to run it, how it scored, where it came from."""
from __future__ import annotations

import json

from longlive_core.models.folder import DiTFolder
from longlive_core.package.encoders import encoder_lines


def model_card(name: str, version: str, model_config: DiTFolder, scores: dict, lineage: dict,
               config_stages: tuple[str, ...]) -> str:
    """``model_config``: the bundled model/config.json (its encoder paths as the bundle gives them);
    ``config_stages``: the stages whose params are in configs/."""
    agg, verdict = scores["aggregate"], scores["verdict"]
    dit, video = model_config.dit_config, model_config.video
    lines = [
        f"# {name} {version}", "",
        f"A LongLive-2.0 W4A4 video generator ({model_config.dit['name']} DiT, {dit.num_layers} blocks, dim "
        f"{dit.dim}; {video.width}x{video.height} at {video.fps:g} fps; sampling steps "
        f"{list(model_config.sampling.steps or ())}), made by this project's pipeline.", "",
        "## Run it", "",
        "```bash",
        "longlive bundle verify .            # every file against SHA256SUMS",
        "longlive generate --model model --prompts story.txt --out story.mp4",
        "```", "",
        "`model/` is the merged W4A4 model (compressed-tensors' nvfp4-pack-quantized layout), `lora/` the",
        "distilled generator's LoRA as a peft adapter for the AR model, `configs/<stage>.yaml` the parameters",
        f"each stage that made them ran with ({', '.join(f'`{s}`' for s in config_stages)}).", "",
        "## Encoders", "",
        *encoder_lines(model_config), "",
        "## Evaluation", "",
        "| video | frames | temporal flickering | within-shot consistency | shot-switch accuracy |",
        "|---|---|---|---|---|",
    ]
    for video_name, v in sorted(scores["videos"].items()):
        lines.append(f"| {video_name} | {v['frames']} | {v['temporal_flickering']:.4f} | "
                     f"{v['within_shot_consistency']:.4f} | {v['shot_switch_accuracy']:.2f} |")
    lines += [f"| **mean** | | {agg['temporal_flickering']:.4f} | {agg['within_shot_consistency']:.4f} | "
              f"{agg['shot_switch_accuracy']:.2f} |", "",
              f"Verdict: **{'pass' if verdict['passed'] else 'fail'}**"
              + (f" against {verdict['champion']}" if verdict["champion"] else "") + ".", ""]
    lines += [f"- {reason}" for reason in verdict["reasons"]]
    lines += ["", "## Lineage", "", "```json", json.dumps(lineage, indent=2, sort_keys=True), "```", ""]
    return "\n".join(lines)
