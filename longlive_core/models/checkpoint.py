"""DiT weights from local directories, in either published layout, never through pickle.

- The original Wan2.2 layout: ``diffusion_pytorch_model-0000N-of-0000M.safetensors`` shards with a
  ``*.safetensors.index.json`` weight map (or one ``.safetensors`` file); its key names are ours.
- The Diffusers layout (``WanTransformer3DModel``: ``condition_embedder.*``, ``blocks.N.attn1.to_q``
  ...), e.g. the ``transformer/`` folder of a Diffusers pipeline; renamed on load.

Only safetensors are read. Shapes and names are checked against the config before anything is
assigned, and the error lists what is missing or unexpected.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from longlive_core.io.atomic import atomic_dir, write_json
from longlive_core.models.config import DiTConfig
from longlive_core.models.folder import CONFIG
from longlive_core.models.wan_dit import WanDiT
from longlive_core.models.weights import CheckpointError

# Diffusers name -> original Wan name, applied in order to each key (first match of each pair)
_DIFFUSERS_TO_WAN = (
    ("condition_embedder.time_embedder.linear_1.", "time_embedding.0."),
    ("condition_embedder.time_embedder.linear_2.", "time_embedding.2."),
    ("condition_embedder.text_embedder.linear_1.", "text_embedding.0."),
    ("condition_embedder.text_embedder.linear_2.", "text_embedding.2."),
    ("condition_embedder.time_proj.", "time_projection.1."),
    (".scale_shift_table", ".modulation"),
    (".ffn.net.0.proj.", ".ffn.0."),
    (".ffn.net.2.", ".ffn.2."),
    (".norm2.", ".norm3."),  # Diffusers' affine cross-attention norm is Wan's norm3
    (".attn1.to_out.0.", ".self_attn.o."),
    (".attn1.to_", ".self_attn."),
    (".attn1.norm_", ".self_attn.norm_"),
    (".attn2.to_out.0.", ".cross_attn.o."),
    (".attn2.to_", ".cross_attn."),
    (".attn2.norm_", ".cross_attn.norm_"),
)


def diffusers_to_wan_key(key: str) -> str:
    if key == "scale_shift_table":
        return "head.modulation"
    if key.startswith("proj_out."):
        return "head.head." + key.removeprefix("proj_out.")
    for old, new in _DIFFUSERS_TO_WAN:
        if old in key:
            key = key.replace(old, new)
    return key


def is_diffusers_layout(keys) -> bool:
    return any(k.startswith("condition_embedder.") or ".attn1." in k for k in keys)


def to_wan_layout(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {diffusers_to_wan_key(k): v for k, v in state.items()} if is_diffusers_layout(state) else dict(state)


def _missing_weights(path: Path) -> CheckpointError:
    return CheckpointError(
        f"no DiT weights at {path}: put the Wan2.2-TI2V-5B transformer there (the original layout's "
        "diffusion_pytorch_model*.safetensors with its .index.json, or a Diffusers transformer/ folder), "
        "or point the model path in params.yaml at where they are")


def check_dit_weights(path: str | Path) -> None:
    """Raises CheckpointError, saying what to put there, unless ``path`` holds safetensors weights
    (a file, or a folder of shards) to read; a quick look before anything starts."""
    path = Path(path)
    if not (path.is_file() or (path.is_dir() and any(path.glob("*.safetensors")))):
        raise _missing_weights(path)


def load_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """One safetensors file's tensors; a file cut short or damaged is one CheckpointError saying so."""
    from safetensors import SafetensorError

    try:
        return load_file(path)
    except (SafetensorError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CheckpointError(f"{path} cannot be read as safetensors ({first}): the file is damaged or was cut "
                              "short; copy it again or rerun the stage that writes it") from None


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a .safetensors file, or of a directory's shards (through its index when it has one)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(f"{path}: only .safetensors weights are read (no pickle files)")
        return load_safetensors(path)
    if not path.is_dir():
        raise _missing_weights(path)
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(f"{path} has several weight indexes ({', '.join(p.name for p in indexes)}); keep one")
    if indexes:
        try:
            weight_map = json.loads(indexes[0].read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{indexes[0]} is not a weight index (JSON with a 'weight_map'): {exc}") from exc
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if Path(shard).name != shard or not (path / shard).is_file():
                raise CheckpointError(f"{indexes[0]} names shard {shard!r}, which is not a file beside it")
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        if not shards:
            raise _missing_weights(path)
    state: dict[str, torch.Tensor] = {}
    for shard in shards:
        state.update(load_safetensors(path / shard))
    return state


def load_dit(path: str | Path, cfg: DiTConfig, dtype: torch.dtype | None = None,
             device: str | torch.device = "cpu") -> WanDiT:
    """A WanDiT with every weight from ``path`` (either layout), checked against ``cfg``."""
    state = to_wan_layout(read_safetensors(path))
    with torch.device("meta"):
        model = WanDiT(cfg)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state) if tuple(expected[k].shape) != tuple(state[k].shape))
    if missing or unexpected or wrong:
        def few(keys):
            return ", ".join(keys[:5]) + (f" (+{len(keys) - 5} more)" if len(keys) > 5 else "")
        problems = [f"{label}: {few(keys)}" for label, keys in
                    (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong)) if keys]
        raise CheckpointError(f"{path} does not fit the DiT config {cfg}: " + "; ".join(problems))
    state = {k: v.to(device=device, dtype=dtype or v.dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


SHARD_PATTERN = "diffusion_pytorch_model*.safetensors*"  # the shards and the index save_dit writes




def save_dit(model: WanDiT, directory: str | Path, max_shard_bytes: int = 5 * 1024**3,
             config: dict | None = None) -> None:
    """Writes the original layout (safetensors shards plus a weight-map index, and ``config`` as
    config.json) as a whole: into a staging folder beside ``directory``, which then takes its place,
    so a crash leaves the old checkpoint or the new one, never a mix (a crash between the two renames
    leaves the old one aside, and the next save puts it back first). A folder holding anything else
    is refused."""
    directory = Path(directory)
    if directory.is_symlink():
        raise CheckpointError(f"{directory} is a symbolic link; save the DiT into a real folder")
    if directory.exists():
        foreign = sorted(p.name for p in directory.iterdir() if not p.match(SHARD_PATTERN) and p.name != CONFIG)
        if foreign:
            raise CheckpointError(f"{directory} holds other files ({', '.join(foreign[:5])}); save the DiT into "
                                  "an empty folder or one that holds only an earlier save_dit checkpoint")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    with atomic_dir(directory) as staging:
        weight_map = {}
        for i, shard in enumerate(shards, start=1):
            name = f"diffusion_pytorch_model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.fspath(staging / name))
            weight_map.update({k: name for k in shard})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                 "weight_map": weight_map}
        write_json(index, staging / "diffusion_pytorch_model.safetensors.index.json")
        if config is not None:
            write_json(config, staging / CONFIG)
