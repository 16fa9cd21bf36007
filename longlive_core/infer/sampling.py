"""How a model folder is sampled: its own ``sampling`` (the steps, window and sinks it was made for)
unless ``generate``'s params or a flag say otherwise, explicitly. A distilled (few-step) folder runs
its step list; an AR (flow-matching) folder its own shifted schedule with ``generate.ar_steps``
steps. What ran, and where each setting came from, goes into the video's sidecar."""
from __future__ import annotations

import dataclasses

from longlive_core.config import ConfigError
from longlive_core.infer.config import RolloutConfig
from longlive_core.infer.engine import GenerateConfig
from longlive_core.models.folder import DiTFolder

FOLDER, PARAMS = "model folder", "generate params"


@dataclasses.dataclass(frozen=True)
class RunSampling:
    rollout: RolloutConfig  # chunk frames, steps, window, sinks: what runs
    source: dict[str, str]  # setting -> where it came from (FOLDER, PARAMS, "--steps N")


def run_sampling(folder: DiTFolder, cfg: GenerateConfig, steps: int | None = None) -> RunSampling:
    """``steps``: a step count asked for (``--steps``, ``evaluate.steps``): the folder's own list when
    it has that many, else the list of that length in ``generate.step_lists`` (an AR folder: its
    schedule with that many steps)."""
    from longlive_core.infer.rollout import teacher_schedule

    own = folder.sampling
    many_step = own.kind == "flow-matching"

    def ar_schedule(n: int, asked: str) -> tuple[int, ...]:
        """The AR folder's own schedule in ``n`` steps (``asked``: the setting, for the error)."""
        try:
            return teacher_schedule(n, own.timestep_shift or 5.0, own.num_train_timesteps or 1000)
        except ValueError as exc:
            raise ConfigError(f"{asked}: this AR folder's {exc}") from None

    if steps is not None:
        source = f"--steps {steps}"
        if steps < 1:
            raise ConfigError(f"--steps must be at least 1; got {steps}")
        if many_step:
            step_list = ar_schedule(steps, source)
        elif own.steps is not None and len(own.steps) - 1 == steps:
            step_list, source = tuple(own.steps), FOLDER
        else:
            step_list = next((s for s in cfg.step_lists if len(s) - 1 == steps), None)
            if step_list is None:
                have = ", ".join(str(len(s) - 1) for s in cfg.step_lists)
                raise ConfigError(f"{steps} steps: the model folder's list has {len(own.steps or ()) - 1} and "
                                  f"generate.step_lists has {have}-step lists; add a {steps}-step list there")
    elif cfg.step_list is not None:
        step_list, source = tuple(cfg.step_list), PARAMS
    elif many_step:
        step_list = ar_schedule(cfg.ar_steps, f"generate.ar_steps is {cfg.ar_steps}")
        source = f"{PARAMS} (ar_steps {cfg.ar_steps} on the folder's schedule)"
    elif own.steps is not None:
        step_list, source = tuple(own.steps), FOLDER
    else:
        step_list, source = cfg.step_lists[0], PARAMS
    chosen = {"steps": source}
    picked = {}
    for key in ("window", "global_sink", "shot_sink"):
        asked, recorded = getattr(cfg, key), getattr(own, key)
        if asked is not None:
            picked[key], chosen[key] = asked, PARAMS
        else:
            picked[key], chosen[key] = (recorded if recorded is not None or key == "window" else 0), FOLDER
    try:
        rollout = RolloutConfig(folder.latent.chunk_frames, step_list, picked["window"], picked["global_sink"],
                                picked["shot_sink"])
    except ValueError as exc:
        raise ConfigError(f"generate: {exc} (the window and sinks come from {chosen['window']} and "
                          f"{chosen['global_sink']})") from None
    return RunSampling(rollout, chosen)
