"""activation_checkpointing: budget planned on paper for a shape and a memory no lent machine has: the
production train_ar step (every block of the model, one Balanced-SP rank's tokens) on a GB200's
186 GB, from one block's profile measured on the H200 (bench/profiles/, a plan cache entry that
``bench/train_step.py --ac budget:G --out DIR`` wrote).

    PYTHONPATH=. python bench/ac_projection.py [--profile bench/profiles/h200-wan5b-block-32f-bf16.json]
        [--params configs/production.yaml] [--memory-gb 186 141] [--share 0.9] [--none-mfu 0.516]

A projection, not a measurement. The profile is carried to the production shape this way:
- every op but self-attention: bytes and seconds times s, the production rank's tokens over the
  profile's;
- self-attention (teacher forcing's dense rows: one call per chunk and row kind, every chunk
  attending to the clean frames up to its own): bytes times s, seconds times the ratio of the
  attention work of one rank, chunk_tokens^2 n (n + 1) / sp for n chunks (Ulysses: a rank attends
  for heads/sp heads over every token);
- what a ``full`` step holds besides (``train.ac_planning``'s floor): float32 masters, EMA,
  gradients and AdamW's two moments sharded over the ranks FSDP shards on (a node under
  ``sharding: hybrid``), FSDP's buffers, every block's input, the activations outside the blocks,
  one block's forward and backward at once;
- the knapsack of ``distributed/ac_plan.py`` over what ``--share`` of the memory leaves above that;
- the step's time as forward + backward (twice the forward) + what is recomputed, so a plan that
  recomputes r of the forward runs at MFU(none) x 3 / (3 + r); MFU(none) is ``--none-mfu``, the
  H200's measured share of its peak without recomputation (bench/RESULTS.md), taken to carry over.
  Checked on the H200 at the profile's own shape: ``full`` (r = 1) gives 0.75 x 51.6% = 38.7%,
  measured 39.4%. Two bounds: ``mfu_low`` prices r as the eager profile does (a checkpoint's replay
  reruns every op it did not keep), ``mfu_high`` leaves out the ops the backward never reads (the
  compiled partitioner recomputes only what is needed); the H200's measured budget rows lie between
  the two (``--check`` plans them at the profile's own shape).
Left out: Balanced SP's all-to-all (compute only, as bench/sp_projection.py), NVFP4's quantize
kernels (the profile is BF16), and that the compiled partitioner keeps less than the eager profile
prices (the plan is priced as eager: it could keep more than it says).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import torch

from longlive_core.distributed.ac_plan import BlockProfile, plan_blocks
from longlive_core.models.config import dit_config
from longlive_core.models.vae import SPATIAL_STRIDE
from longlive_core.models.wan_dit import WanDiT
from longlive_core.params_overlay import overlaid_params
from longlive_core.train.ac_planning import OutsideBlocks, fsdp_bytes

REPO = Path(__file__).resolve().parents[1]
BF16 = 2


@dataclasses.dataclass(frozen=True)
class Shape:
    """One rank's teacher-forcing sample: ``frames`` latent frames in ``chunk``-frame chunks of
    ``tokens_per_frame``, split over ``sp`` ranks."""

    frames: int
    chunk: int
    tokens_per_frame: int
    sp: int

    @property
    def tokens(self) -> int:  # per rank: the clean and the noisy copy of its frames
        return 2 * self.frames * self.tokens_per_frame // self.sp

    @property
    def attention_work(self) -> float:
        n, chunk_tokens = self.frames // self.chunk, self.chunk * self.tokens_per_frame
        return chunk_tokens**2 * n * (n + 1) / self.sp


def carried(profile: BlockProfile, measured: Shape, target: Shape, dim: int) -> BlockProfile:
    """``profile`` at ``measured`` carried to ``target`` (see the module's docstring)."""
    s = target.tokens / measured.tokens
    a = target.attention_work / measured.attention_work
    chunk_output = measured.chunk * measured.tokens_per_frame * dim * BF16  # and the kernel's small log-sum-exp
    self_attention = [op for op in profile.ops
                      if "scaled_dot_product" in op.id and abs(op.bytes - chunk_output) <= 0.05 * chunk_output]
    if len(self_attention) != 2 * measured.frames // measured.chunk:
        raise SystemExit(f"the profile has {len(self_attention)} chunk-sized attention calls where teacher forcing's "
                         f"rows give {2 * measured.frames // measured.chunk}: not the layout this projection models")
    ids = {op.id for op in self_attention}
    ops = tuple(dataclasses.replace(op, bytes=round(op.bytes * s), seconds=op.seconds * (a if op.id in ids else s))
                for op in profile.ops)
    attention = sum(op.seconds for op in self_attention)
    return BlockProfile(ops, (profile.forward_s - attention) * s + attention * a, round(profile.input_bytes * s),
                        round(profile.transient_bytes * s), profile.device)


def static_bytes(model: WanDiT, shard: int) -> dict[str, int]:
    """A step's memory outside the activations, per rank, as the planner counts it."""
    params = sum(p.numel() for p in model.parameters())
    f32 = 4 * params // shard
    return {"masters_and_ema": 2 * f32, "grads": f32, "optimizer": 2 * f32, "fsdp": fsdp_bytes(model, torch.bfloat16)}


def project(profile: BlockProfile, blocks: int, tokens: int, dim: int, static: dict[str, int], limit: int,
            none_mfu: float) -> dict:
    outside = OutsideBlocks(tokens, dim, BF16)
    parts = {**static, "block_inputs": blocks * profile.input_bytes, "outside": outside.held_bytes,
             "transient": outside.transient(profile.transient_bytes)}
    floor = sum(parts.values())
    plan = plan_blocks({"block": profile}, {"block": blocks}, limit - floor)["block"]
    r = plan.recompute_fraction
    everything = blocks * sum(op.bytes for op in profile.ops if op.candidate)
    # with everything kept, what is still recomputed: ops the backward does not read (eager's replay
    # reruns the whole forward; the compiled partitioner skips what nothing needs)
    unread = sum(op.seconds for op in profile.ops if not op.candidate) / profile.forward_s
    return {"limit_gib": limit / 2**30, "floor_gib": floor / 2**30, "kept_gib": blocks * plan.saved_bytes / 2**30,
            "predicted_peak_gib": (floor + blocks * plan.saved_bytes) / 2**30, "recompute_fraction": r,
            "mfu_low": none_mfu * 3 / (3 + r), "mfu_high": none_mfu * 3 / (3 + max(r - unread, 0.0)),
            "full_mfu": none_mfu * 3 / 4,
            "keep_everything_gib": (floor + everything) / 2**30, "recompute_fraction_keeping_everything": unread,
            "floor_parts_gib": {k: round(v / 2**30, 2) for k, v in parts.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--profile", type=Path, default=REPO / "bench/profiles/h200-wan5b-block-32f-bf16.json")
    ap.add_argument("--params", type=Path, default=REPO / "configs/production.yaml")
    ap.add_argument("--memory-gb", type=float, nargs="+", default=[186.0, 141.0],
                    help="GPU memory, GB (GB200: 186; H200: 141)")
    ap.add_argument("--share", type=float, default=0.9, help="of the memory, the step's peak limit")
    ap.add_argument("--none-mfu", type=float, default=0.516,
                    help="MFU without recomputation, measured on the H200 (bench/RESULTS.md, 8 blocks)")
    ap.add_argument("--check", type=float, nargs="*", default=[47.0, 65.0],
                    help="limits (GiB) to plan at the profile's own shape and floor, to set beside measured rows")
    args = ap.parse_args()
    entry = json.loads(args.profile.read_text())
    key = entry["key"]
    profile = BlockProfile.from_json(entry["profile"])
    measured = Shape(key["window"], key["chunk"], key["grid"][0] * key["grid"][1], key["sp"])
    params = overlaid_params(REPO / "params.yaml", args.params)
    t = params["train_ar"]
    cfg = dit_config(t["model"])
    if (cfg.dim, cfg.ffn_dim, cfg.num_heads) != (key["dit"]["dim"], key["dit"]["ffn_dim"], key["dit"]["num_heads"]):
        raise SystemExit(f"the profile is of a block of dim {key['dit']['dim']}, the params' model {t['model']} is not")
    clip = params["encode_latents"]["clip"]
    _, ph, pw = cfg.patch_size
    tpf = (clip["height"] // SPATIAL_STRIDE // ph) * (clip["width"] // SPATIAL_STRIDE // pw)
    target = Shape(t["max_latent_frames"], t["chunk_frames"], tpf, t.get("sp", 1))
    shard = t["nproc"] if t.get("sharding", "full") == "hybrid" else t["nnodes"] * t["nproc"]
    with torch.device("meta"):
        model = WanDiT(cfg)
    at_target = carried(profile, measured, target, cfg.dim)
    rows = []
    print(f"# {cfg.num_layers} blocks of {t['model']}, {target.frames} latent frames over sp {target.sp}: "
          f"{target.tokens:,} tokens per rank (the profile: {measured.tokens:,}); FSDP shards over {shard} ranks; "
          f"MFU(none) {args.none_mfu:.1%} (the H200's); a projection, not a measurement")
    for gb in args.memory_gb:
        row = {"memory_gb": gb, "blocks": cfg.num_layers, "tokens_per_rank": target.tokens,
               **project(at_target, cfg.num_layers, target.tokens, cfg.dim, static_bytes(model, shard),
                         int(args.share * gb * 1e9), args.none_mfu)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    blocks = sum(key["kinds"].values())
    print(f"# at the profile's own shape ({blocks} blocks, {measured.tokens:,} tokens, its measured floor parts), "
          "to set beside the measured budget rows", flush=True)
    parts = entry["floor_parts"]
    static = {k: parts[k] for k in ("resident", "grads", "optimizer", "fsdp")}
    for gib in args.check:
        row = {"check_limit_gib": gib, "blocks": blocks, "tokens_per_rank": measured.tokens,
               **project(profile, blocks, measured.tokens, key["dit"]["dim"], static, int(gib * 2**30),
                         args.none_mfu)}
        rows.append(row)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
