"""Prompt enhancement (Kling, seed 000): a local language model rewrites a prompt file's prompts into
the dense caption style the DiT was trained on, all of them in one request, so a subject keeps its
name and description across shots.

The request (``configs/enhance/rewrite.txt``) numbers the prompts, one per line, and shows a few
training captions as examples of the style (``ExampleBank``: the captions nearest the prompts by the
cosine of their pooled text-encoder embeddings). The reply must give back exactly those numbers, each
once, each with a prompt; the file is then rebuilt line by line, every line keeping what precedes its
prompt (the ``+`` of a change inside a shot, the duration and its tab), and the scene-transition prefix
is added as for any prompt file (``prompts.parse_prompts``). A reply that does not give that structure
back, or gives a file that does not read, leaves the prompt file as given, with the reason: the video
is still made, from the user's own words.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import string
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from longlive_core.infer.prompts import PromptFileError, parse_prompts

TEMPLATE = Path(__file__).resolve().parents[2] / "configs" / "enhance" / "rewrite.txt"
_NUMBERED = re.compile(r"^\s*(\d+)\s*[.:)]\s*(.*?)\s*$")


@dataclasses.dataclass(frozen=True)
class Enhancement:
    original: str  # the prompt file as given
    enhanced: str  # the prompt file to generate from: the original where it was not rewritten
    rewritten: bool
    reason: str  # why the original was kept ("" when rewritten)
    examples: tuple[str, ...]  # the training captions the request showed

    def record(self) -> dict:
        """What the sidecar keeps."""
        return dataclasses.asdict(self)


def template_text(path: Path = TEMPLATE) -> str:
    return path.read_text(encoding="utf-8")


def template_digest(path: Path = TEMPLATE) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def build_request(prompts: Sequence[str], examples: Sequence[str], template: str) -> str:
    shown = "".join(f"Example of the style: {e}\n" for e in examples)
    numbered = "\n".join(f"{n}. {p}" for n, p in enumerate(prompts, start=1))
    return string.Template(template).safe_substitute(examples=shown, prompts=numbered)


def parse_reply(reply: str, count: int) -> list[str] | None:
    """The rewritten prompts in order, or None unless the reply numbers 1..count each once, non-empty
    (lines that are not numbered, such as a preamble, are ignored)."""
    found: dict[int, str] = {}
    for line in reply.splitlines():
        m = _NUMBERED.match(line)
        if m is None:
            continue
        n, prompt = int(m.group(1)), m.group(2)
        if n in found or not 1 <= n <= count or not prompt:
            return None
        found[n] = prompt.replace("\t", " ")
    if len(found) != count:
        return None
    return [found[n] for n in range(1, count + 1)]


def enhance(text: str, rewrite: Callable[[str], str], examples: Sequence[str] = (), template: str | None = None,
            source: str = "the prompt file") -> Enhancement:
    """``text`` (a prompt file, read before anything is asked of the model: a bad line is the user's
    error, as without enhancement) rewritten by ``rewrite`` (request -> reply)."""
    segments = parse_prompts(text, 1.0, source)
    request = build_request([s.text for s in segments], examples, template or template_text())
    examples = tuple(examples)
    new = parse_reply(rewrite(request), len(segments))
    if new is None:
        return Enhancement(text, text, False, f"the model's reply did not give back {len(segments)} numbered prompts",
                           examples)
    rows = text.removeprefix("\ufeff").splitlines()
    for segment, prompt in zip(segments, new):
        rows[segment.line - 1] = segment.head + prompt
    rebuilt = "\n".join(rows) + "\n"
    try:
        reread = parse_prompts(rebuilt, 1.0, "the rewritten prompt file")
    except PromptFileError as e:
        return Enhancement(text, text, False, f"the rewritten file does not read: {e}", examples)
    shape = lambda segs: [(s.line, s.shot, s.new_shot, s.duration_s) for s in segs]  # noqa: E731
    if shape(reread) != shape(segments):  # a rewrite that begins with '+' would make a shot a prompt change
        return Enhancement(text, text, False, "the rewritten file's shots and prompt changes differ from the file's",
                           examples)
    return Enhancement(text, rebuilt, True, "", examples)


def pooled(embedding: np.ndarray, mask: np.ndarray | None = None) -> np.ndarray:
    """(L, D) token embeddings -> (D,) their mean over the tokens ``mask`` keeps, of unit length."""
    e = np.asarray(embedding, dtype=np.float32)
    keep = np.ones(len(e), dtype=bool) if mask is None else np.asarray(mask, dtype=bool)
    v = e[keep].mean(axis=0) if keep.any() else np.zeros(e.shape[1], dtype=np.float32)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def pooled_prompt(embedding: np.ndarray) -> np.ndarray:
    """A text encoder's (L, D) output for one prompt, pooled over the prompt's own tokens: the rows past
    them are zero (models/text.py). The one pooling of both sides of the example search, a prompt's at
    generate time and a training caption's in the latent cache (latents/example_bank.py)."""
    e = np.asarray(embedding, dtype=np.float32)
    return pooled(e, np.abs(e).sum(axis=1) > 0)


@dataclasses.dataclass(frozen=True)
class ExampleBank:
    """Training captions and their pooled text-encoder embeddings (unit rows), kept with a model folder
    so that a bundle user needs no latent cache."""
    captions: tuple[str, ...]
    embeddings: np.ndarray  # (N, D) float32

    def nearest(self, query: np.ndarray, k: int) -> list[str]:
        """The k captions of largest cosine with ``query`` (a pooled embedding), most similar first; ties by
        position."""
        if not self.captions or k <= 0:
            return []
        scores = self.embeddings @ (np.asarray(query, dtype=np.float32) / max(float(np.linalg.norm(query)), 1e-12))
        order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
        return [self.captions[i] for i in order[:k]]

    def save(self, folder: Path) -> None:
        from safetensors.numpy import save_file

        folder.mkdir(parents=True, exist_ok=True)
        save_file({"embeddings": np.ascontiguousarray(self.embeddings, dtype=np.float32)},
                  str(folder / "enhance_examples.safetensors"))
        (folder / "enhance_examples.json").write_text(json.dumps({"captions": list(self.captions)}, indent=1),
                                                     encoding="utf-8")

    @classmethod
    def load(cls, folder: Path) -> ExampleBank | None:
        """The folder's bank, None when it has none."""
        from safetensors.numpy import load_file

        tensors, texts = folder / "enhance_examples.safetensors", folder / "enhance_examples.json"
        if not tensors.is_file() or not texts.is_file():
            return None
        captions = tuple(json.loads(texts.read_text(encoding="utf-8"))["captions"])
        embeddings = load_file(str(tensors))["embeddings"]
        if embeddings.shape[0] != len(captions):
            raise ValueError(f"{folder}: {embeddings.shape[0]} example embeddings for {len(captions)} captions")
        return cls(captions, embeddings)
