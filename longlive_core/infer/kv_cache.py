"""The self-attention KV cache of chunk-by-chunk generation, with the multi-shot attention sink.

Generation runs the model on one chunk of latent frames at a time. Each block's self-attention
reads the keys and values of the clean chunks made before (the cache) and of the chunk itself, with
no mask: exactly what a noisy chunk sees in teacher-forcing training (itself and the clean chunks
before it), and what a clean chunk sees there (the clean chunks up to itself) when the finished
chunk is run once more at t = 0 to write its own keys and values.

``window`` counts every latent frame a chunk attends to, its own and the sinks included (MISSION.md
"Multi-shot conventions", the public code's local attention size): the cache holds at most
``window`` minus a chunk's frames (None: everything). When a write would pass that, the oldest frames
go, except the two sinks (REFERENCE.md §1): the global sink, the first ``global_frames`` of the video,
and the shot sink, the first ``shot_frames`` of the current shot. The sinks are spans (start, length)
over the frames the cache holds, not copies: a new shot (``start_shot``) moves the shot sink's start
to where the shot's first frame will be written, and the previous shot's sink frames age out like
any other. Keys and values as computed sit in one buffer a layer with room for a chunk after the
window (``PlainWindow``: a read copies only the chunk's own rows, at the cost of that room's memory,
a chunk's keys and values in every layer). They may be held in NVFP4 or FP8 (``kv_quant.py``),
dequantized to the compute dtype for each read (on a GPU by Triton launches that write the window
once: ``kv_attention.window``) and attended by SDPA. With ``attention="fp8"`` (cuDNN's FP8 SDPA) a
chunk's first pass puts that window in E4M3 and keeps it (``FP8Window``; not a video's first chunk,
which has no cached rows); its later passes quantize only their own rows into it, and the next write
drops it. (Dequantizing inside the attention kernel instead,
``kv_attention.nvfp4_cache_attention``, measured 3.9x slower than this on the H200: every query tile
decodes the whole window again; bench/RESULTS.md.)
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from longlive_core.infer.attention_cudnn_fp8 import attention_fp8_window
from longlive_core.infer.attention_fp8_io import HEADROOM, FP8Window
from longlive_core.infer.config import SinkConfig
from longlive_core.infer.kv_attention import smoothed, window
from longlive_core.infer.kv_quant import KVQuantConfig
from longlive_core.models.attention import MaskMod, attend

# how a chunk attends over the window: SDPA in the activations' dtype, or cuDNN's FP8 SDPA (Hopper or
# newer; infer/attention_cudnn_fp8.py: its error and speed in bench/RESULTS.md)
ATTENTIONS = ("sdpa", "fp8")


@dataclasses.dataclass(frozen=True)
class Span:
    """Frames [start, start + length) of the cache."""
    start: int = 0
    length: int = 0

    @property
    def stop(self) -> int:
        return self.start + self.length

    def __contains__(self, frame: int) -> bool:
        return self.start <= frame < self.stop


@dataclasses.dataclass(frozen=True)
class PlainWindow:
    """One layer's cached keys or values as computed, (B, H, T, D): the first ``tokens`` rows of
    ``rows``, a buffer with room after them for a chunk's own. A read that carries no gradient copies
    the chunk's own rows into that room (with FP8 attention, a chunk's first read only) and attends over
    one view of the buffer, where concatenating [cache; own] would copy the whole window for every pass
    of every layer. Rows below ``tokens`` are never written again: a write pass that drops frames fills
    a new buffer, so an attention that holds an older window (activation checkpointing's recomputation)
    reads what it read before."""
    rows: torch.Tensor
    tokens: int
    data: torch.Tensor = dataclasses.field(init=False, repr=False)  # the held rows, a view made once

    def __post_init__(self):
        object.__setattr__(self, "data", self.rows[:, :, :self.tokens])

    @property
    def nbytes(self) -> int:
        """The held rows' bytes (the room after them is not counted)."""
        return self.data.numel() * self.data.element_size()

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        return self.data.to(dtype)

    def fits(self, own: torch.Tensor) -> bool:
        """Whether ``own`` can follow the held rows in the buffer, as they are (the same dtype and device)."""
        return (own.dtype == self.rows.dtype and own.device == self.rows.device
                and own.shape[:2] == self.rows.shape[:2] and own.shape[3] == self.rows.shape[3]
                and self.tokens + own.shape[2] <= self.rows.shape[2])

    def with_own(self, own: torch.Tensor) -> torch.Tensor:
        """[the held rows; ``own``] along the tokens: ``own`` copied into the room, the buffer's view
        returned (``fits`` first)."""
        end = self.tokens + own.shape[2]
        self.rows[:, :, self.tokens:end].copy_(own)
        return self.rows[:, :, :end]


def buffer_size(kept: int, chunk: int, capacity: int | None) -> int:
    """Tokens of a new ``PlainWindow`` buffer holding ``kept``: room for two chunks (the next chunk's reads,
    then its write in place), at most ``capacity`` (the window's: a chunk's room once it is full)."""
    return max(kept, kept + 2 * chunk if capacity is None else min(capacity, kept + 2 * chunk))


def largest_buffer(writes: int, chunk: int, capacity: int | None) -> int:
    """The largest buffer (tokens) one layer of a BF16 cache takes over ``writes`` writes of ``chunk``
    tokens, its window ``capacity`` tokens (None: unbounded): what a rollout's cache holds at most."""
    kept = size = most = 0
    for _ in range(writes):
        total = kept + chunk
        kept = total if capacity is None else min(total, capacity - chunk)  # the window drops the oldest
        if kept < total or total > size:
            size = buffer_size(kept, chunk, capacity)
        most = max(most, size)
    return most


def appended(held: list[PlainWindow], new: torch.Tensor, ranges: list[tuple[int, int]],
             capacity: int | None, in_room: bool = False) -> list[PlainWindow]:
    """The token ``ranges`` of [``held``; ``new``] as one ``PlainWindow``: in place where nothing is
    dropped and ``new`` fits the room, else in a new buffer (``buffer_size``), the kept ranges copied
    once. A buffer grows only as the cache does: it holds at most two chunks more than the cache.
    ``in_room``: ``new`` is already in the room (this pass's in-place read put it there)."""
    old = held[0] if held else None
    total = (old.tokens if old else 0) + new.shape[2]
    if old is not None and ranges == [(0, total)] and old.fits(new):
        if not in_room:
            old.with_own(new)
        return [PlainWindow(old.rows, total)]
    kept = sum(hi - lo for lo, hi in ranges)
    b, h, _, d = new.shape
    rows = new.new_empty((b, h, buffer_size(kept, new.shape[2], capacity), d))
    parts = ([old.data] if old is not None else []) + [new]
    at = 0
    for lo, hi in ranges:
        offset = 0
        for part in parts:  # a range may span the held rows and the new ones
            a, z = max(lo, offset), min(hi, offset + part.shape[2])
            if a < z:
                rows[:, :, at:at + z - a].copy_(part[:, :, a - offset:z - offset])
                at += z - a
            offset += part.shape[2]
    return [PlainWindow(rows, kept)]


class KVCache:
    def __init__(self, num_layers: int, tokens_per_frame: int, window: int | None = None,
                 quant: KVQuantConfig | None = None, sink: SinkConfig | None = None, attention: str = "sdpa"):
        """``window``: the latent frames a chunk attends to, itself included (None: every frame before it).
        ``quant``: hold the cached keys and values in its format (``infer/kv_quant.py``); None: as computed.
        ``sink``: the global and shot sinks (None: none). ``attention``: how a chunk attends over the window
        (``ATTENTIONS``)."""
        if window is not None and window < 1:
            raise ValueError(f"the cache window must be at least one latent frame; got {window}")
        if attention not in ATTENTIONS:
            raise ValueError(f"attention must be one of {ATTENTIONS}; got {attention!r}")
        self.attention = attention
        self.num_layers, self.tokens_per_frame, self.window = num_layers, tokens_per_frame, window
        self.quant, self.sink = quant, sink or SinkConfig()
        # per layer, a PlainWindow (in a list of one), or ``quant``'s written chunks in time order
        self.keys: list[list] = [[] for _ in range(num_layers)]
        self.values: list[list] = [[] for _ in range(num_layers)]
        self.key_mean: list[torch.Tensor | None] = [None] * num_layers  # K-smoothing's, from the first chunk
        # per layer, with attention fp8: (the cached chunks it was made from, the window in E4M3 a chunk's
        # first pass made) for its later passes; dropped at the next write. Not in ``nbytes``: ~5 GB over
        # 30 layers at the paper's window, all held between a chunk's passes
        self.fp8_windows: list[tuple[list, FP8Window] | None] = [None] * num_layers
        self.frames = 0  # latent frames held (every layer, once a write pass is complete)
        self.video_frames = 0  # latent frames written since the video began
        self.global_sink, self.shot_sink = Span(), Span()
        self._keep: list[tuple[int, int]] | None = None  # frame ranges the running write pass keeps
        self._new_frames = 0
        self._writes: list[int] = []  # per layer, the appends of the running write pass

    @property
    def writing(self) -> bool:
        return self._keep is not None

    @property
    def nbytes(self) -> int:
        """Bytes the cached keys and values take, every layer."""
        return sum(c.nbytes for held in self.keys + self.values for c in held)

    def for_layer(self, index: int) -> CachedAttention:
        return CachedAttention(self, index)

    def start_shot(self) -> None:
        """The next frames written begin a new shot: the shot sink moves to them."""
        if self.writing:
            raise RuntimeError("a shot cannot start in the middle of a write pass")
        self.shot_sink = Span(self.frames, 0)

    @contextlib.contextmanager
    def write(self, frames: int):
        """Within it, one forward over ``frames`` new latent frames appends their keys and values to
        every layer, dropping what the window no longer holds."""
        if self.writing:
            raise RuntimeError("write passes do not nest")
        self.sink.check(self.window, frames)
        total = self.frames + frames
        grown = Span(self.global_sink.start, min(self.sink.global_frames, self.video_frames + frames))
        shot = Span(self.shot_sink.start, min(self.sink.shot_frames, total - self.shot_sink.start))
        keep = self._kept(total, frames, [grown, shot])
        self._keep, self._new_frames, self._writes = keep, frames, [0] * self.num_layers
        try:
            yield
            if any(n != 1 for n in self._writes):
                raise RuntimeError(f"a write pass must run every layer once; the layers ran {self._writes} times")
        finally:
            self._keep = None
        moved = lambda s: Span(sum(min(hi, s.start) - lo for lo, hi in keep if lo < s.start), s.length)  # noqa: E731
        self.global_sink, self.shot_sink = moved(grown), moved(shot)
        self.frames = sum(hi - lo for lo, hi in keep)
        self.video_frames += frames

    def _kept(self, total: int, chunk: int, sinks: list[Span]) -> list[tuple[int, int]]:
        """The frame ranges of [held; new] that stay: every frame while they and a next ``chunk`` fit
        the window, else the sinks and the newest of the rest."""
        room = None if self.window is None else self.window - chunk
        if room is None or total <= room:
            return [(0, total)]
        pinned = [f for f in range(total) if any(f in s for s in sinks)]
        rest = [f for f in range(total) if not any(f in s for s in sinks)]
        kept = sorted(pinned + rest[len(rest) - (room - len(pinned)):])  # check() keeps room >= pinned
        ranges: list[tuple[int, int]] = []
        for f in kept:
            if ranges and ranges[-1][1] == f:
                ranges[-1] = (ranges[-1][0], f + 1)
            else:
                ranges.append((f, f + 1))
        return ranges

    def _append(self, index: int, k: torch.Tensor, v: torch.Tensor, in_room: bool = False) -> None:
        """``in_room``: the layer's read put ``k`` and ``v`` in its buffers' room (``PlainWindow.with_own``)."""
        k, v = k.detach(), v.detach()
        tpf = self.tokens_per_frame
        self.fp8_windows[index] = None  # it held the window this write changes
        self._writes[index] += 1
        if self._writes[index] > 1:
            raise RuntimeError(f"layer {index} ran twice in one write pass")
        if k.shape[2] != self._new_frames * tpf:
            raise ValueError(f"a write pass of {self._new_frames} frames appends {self._new_frames * tpf} tokens a "
                             f"layer; layer {index} got {k.shape[2]}")
        ranges = [(lo * tpf, hi * tpf) for lo, hi in self._keep]
        if self.quant is None:  # one buffer a layer, with room for a chunk after what the window holds
            capacity = None if self.window is None else self.window * tpf
            self.keys[index] = appended(self.keys[index], k, ranges, capacity, in_room)
            self.values[index] = appended(self.values[index], v, ranges, capacity, in_room)
            return
        if self.quant.smooth_keys and self.key_mean[index] is None:
            self.key_mean[index] = k.float().mean(dim=(0, 2), keepdim=True)  # (1, H, 1, D)
        k = smoothed(k, self.key_mean[index])
        self.keys[index] = select(self.keys[index] + [self.quant.chunk(k)], ranges)
        self.values[index] = select(self.values[index] + [self.quant.chunk(v)], ranges)


def select(chunks: list, ranges: list[tuple[int, int]]) -> list:
    """The token ranges (over the chunks laid end to end) of a layer's chunks, cut where a range
    ends inside one."""
    out, offset = [], 0
    for chunk in chunks:
        end = offset + chunk.tokens
        for lo, hi in ranges:
            a, b = max(lo, offset), min(hi, end)
            if a < b:
                out.append(chunk.slice(a - offset, b - offset))
        offset = end
    return out


class CachedAttention:
    """Block ``index``'s ``attention_fn`` for one forward: attends over [cache; current] and, in a write
    pass, appends the current keys and values to the cache after using them. It holds the cache as it
    was when the forward began, so activation checkpointing, which calls it again in the backward
    after later chunks were written, recomputes what the forward computed."""

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index
        self.past_k, self.past_v, self.writing = cache.keys[index], cache.values[index], cache.writing
        self.key_mean = cache.key_mean[index]

    @torch.compiler.disable  # a compiled block would guard on (and recompile for) every shape of the cache
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_mod: MaskMod | None) -> torch.Tensor:
        if mask_mod is not None:
            raise ValueError("cached attention takes no mask: the cache holds exactly what the chunk may see")
        fp8 = self.cache.attention == "fp8"
        held = self._held_fp8(q, k, v) if fp8 else None
        in_room = held is None and self._in_place(q, k, v)
        if held is not None:  # a later pass of the chunk: its own rows only are quantized, after the cached ones
            held.place(smoothed(k, self.key_mean), v)
        else:
            if in_room:  # the chunk's own rows into the buffer's room: no copy of the window
                full_k, full_v = self.past_k[0].with_own(k), self.past_v[0].with_own(v)
            else:  # the chunk's own keys minus the same K-smoothing mean as the cached ones (a quantized
                # cache's), written into the window as it is made
                full_k, full_v = window(self.past_k, k, self.key_mean), window(self.past_v, v)
            if fp8:  # kept where cached rows are (with none, a later pass would save nothing and risk saturating)
                keep = self._current(q, k, v) and full_k.shape[2] > k.shape[2]
                held = FP8Window.of(full_k, full_v, own=k.shape[2], headroom=HEADROOM if keep else 1.0)
                if keep:
                    self.cache.fp8_windows[self.index] = (self.past_k, held)
        # SDPA with no mask: dense flash attention where there is one
        out = attention_fp8_window(q, held) if fp8 else attend(q, full_k, full_v, None, backend="sdpa")
        if self.writing:  # rows the read put in the room are not copied there again
            self.cache._append(self.index, k, v, in_room)
        return out

    def _current(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Whether this attention reads the cache's newest window, with no gradient."""
        return (self.past_k is self.cache.keys[self.index]
                and not (q.requires_grad or k.requires_grad or v.requires_grad))

    def _held_fp8(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> FP8Window | None:
        """The FP8 window an earlier pass over this cache made, where ``k`` and ``v`` take its own rows' place."""
        kept = self.cache.fp8_windows[self.index]
        if kept is None or kept[0] is not self.past_k or not self._current(q, k, v) or not kept[1].fits(k, v):
            return None
        return kept[1]

    def _in_place(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A BF16 cache's newest window, read with no gradient: the room after its rows is free (a
        window an attention held before a later write is read by concatenation, and so is one that
        any gradient flows through: attention's backward keeps the keys and values it read, and the
        room is written again by the next read)."""
        past_k, past_v = self.past_k, self.past_v
        return (len(past_k) == 1 and isinstance(past_k[0], PlainWindow) and self._current(q, k, v)
                and past_k[0].fits(k) and past_v[0].fits(v))
