"""The prompt file of generation: shots, prompt changes inside a shot, and the frames each gets.

One line per shot, optionally ``<seconds><TAB><prompt>`` (a line without a duration gets the
default); a line starting with ``+`` changes the prompt inside the current shot, its duration the
length of its part of the shot. Blank lines are skipped. Every new shot's prompt after the first
gets "The scene transitions. " in front, as training's captions do. Frame counts follow MISSION.md's
rule: a part of d seconds gets n = max(1, round(d * fps / (stride * F_c))) chunks of F_c latent
frames, a shot is the sum of its parts' chunks, and a shot of N latent frames decodes (with a fresh
VAE cache) to 1 + stride (N - 1) video frames.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

from longlive_core.models.text import SCENE_TRANSITION


class PromptFileError(ValueError):
    """A line of the prompt file that cannot be read; the message names the line."""


@dataclasses.dataclass(frozen=True)
class Segment:
    line: int  # 1-based line of the prompt file
    shot: int
    prompt: str  # as the text encoder gets it (the scene-transition prefix included)
    duration_s: float
    new_shot: bool  # False: a "+" line, a prompt change inside the shot
    head: str = ""  # what precedes the prompt on its line: the "+" of a change, the duration and its tab
    text: str = ""  # the prompt as the line writes it (no scene-transition prefix)


@dataclasses.dataclass(frozen=True)
class ShotPlan:
    index: int
    segments: tuple[Segment, ...]
    chunks: tuple[int, ...]  # chunks of each segment
    chunk_frames: int
    temporal_stride: int

    @property
    def latent_frames(self) -> int:
        return sum(self.chunks) * self.chunk_frames

    @property
    def video_frames(self) -> int:
        return 1 + self.temporal_stride * (self.latent_frames - 1)


def read_prompt_file(path: Path) -> str:
    """The prompt file's text, UTF-8 (a missing or undecodable file is a ``PromptFileError`` naming it)."""
    if not path.is_file():
        raise PromptFileError(f"{path} not found: give a prompt file, one line per shot")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(f"{path} is not UTF-8 text (byte {e.start}): save the prompt file as UTF-8") from None


def parse_prompts(text: str, default_duration_s: float, source: str = "the prompt file",
                  scene_transition: bool = True) -> list[Segment]:
    """``scene_transition``: every shot's prompt after the first begins with ``SCENE_TRANSITION``, as the
    model's training captions did (its folder's ``multi_shot.scene_transition_prefix``)."""
    segments: list[Segment] = []
    shot = -1
    text = text.removeprefix("\ufeff")  # a UTF-8 byte order mark, as some editors write one
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        where = f"{source}, line {number}"
        change = raw.startswith("+")
        if change and shot < 0:
            raise PromptFileError(f"{where}: a '+' line changes the prompt inside a shot, and no shot starts before it")
        body = raw[1:] if change else raw
        duration = default_duration_s
        head = ""
        if "\t" in body:
            head, _, body = body.partition("\t")
            try:
                duration = float(head)
            except ValueError:
                raise PromptFileError(f"{where}: {head!r} before the tab is not a duration in seconds "
                                      "(write 6.5<TAB>prompt, or the prompt alone)") from None
            if not math.isfinite(duration) or duration <= 0:
                raise PromptFileError(f"{where}: the duration must be a positive number of seconds; got {head!r}")
        elif _is_number(body.split(maxsplit=1)[0] if body.split() else ""):
            first = body.split(maxsplit=1)[0]
            raise PromptFileError(f"{where}: {body.strip()!r} starts with a number but has no tab: write "
                                  f"{first}<TAB>prompt for a duration; a prompt that starts with a number gives its "
                                  "duration first: 5<TAB>3 dogs run")
        prompt = body.strip()
        if not prompt:
            raise PromptFileError(f"{where}: no prompt")
        if not change:
            shot += 1
        prefix = SCENE_TRANSITION if scene_transition and not change and shot > 0 else ""
        segments.append(Segment(number, shot, prefix + prompt, duration, not change,
                                ("+" if change else "") + (head + "\t" if "\t" in raw else ""), prompt))
    if not segments:
        raise PromptFileError(f"{source} holds no prompt")
    return segments


def _is_number(word: str) -> bool:
    """A word written as a number: digits (a sign, a point), not the words ``float`` also reads (Nan, inf)."""
    return re.fullmatch(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?", word) is not None


def plan_shots(segments: list[Segment], fps: float, chunk_frames: int, temporal_stride: int = 4) -> list[ShotPlan]:
    """The chunks of every segment and the frames of every shot."""
    per_chunk_s = temporal_stride * chunk_frames / fps
    shots: dict[int, list[Segment]] = {}
    for seg in segments:
        shots.setdefault(seg.shot, []).append(seg)
    return [ShotPlan(k, tuple(segs), tuple(max(1, round(s.duration_s / per_chunk_s)) for s in segs), chunk_frames,
                     temporal_stride) for k, segs in sorted(shots.items())]
