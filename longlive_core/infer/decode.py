"""Decoding generated latents to frames chunk by chunk, and streaming them into the output file.

``ShotDecoder`` runs the Wan VAE's causal decoder one latent frame at a time, as its own ``decode``
does, but keeps the decoder's feature cache between calls, so a shot decoded in chunks gives the
frames of the whole shot decoded at once (tested) and a new shot starts with a fresh cache (each
shot was encoded on its own: MISSION.md). ``FrameStream`` takes each chunk as the DiT finishes it;
asynchronously (the default) it decodes in a worker thread on its own CUDA stream while the DiT
makes the next chunk, and writes in another, holding at most ``depth`` chunks in each queue, so
memory does not grow with the video's length. The VAE may sit on another device than the DiT (a
second GPU): each chunk's latents are copied there as they are handed over.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

from longlive_core.infer.vae_upsample import subpixel_upsampling


class ShotDecoder:
    """``channels_last``: the convolutions' weights and the decoder's input in channels-last layouts
    (cuDNN's fastest for 3-D convolutions in bf16); ``compile``: each decoder call through
    torch.compile with its shapes fixed (a shot's first frame, its second and the rest differ in the
    feature cache they find: three graphs, compiled once, and one more for each other frame count a call
    meets with several frames a call). ``frames_per_call``: latent frames the
    decoder takes in one call after a shot's first frame, which it always takes alone (the decoder
    does not double the time axis of a shot's first call, so that call must hold one frame): fewer,
    larger convolutions and fewer copies of the causal cache, for activations that many times larger.
    ``subpixel``: each nearest 2x upsampling and the 3x3 convolution after it as one 2x2 convolution of
    four phases (``vae_upsample``: about 2.2x fewer FLOPs there). Each leaves the frames as they are up to the
    dtype's rounding (tested); bench/vae_decode.py measures what they gain."""

    def __init__(self, vae, dtype: torch.dtype = torch.float32, channels_last: bool = False, compile: bool = False,
                 frames_per_call: int = 1, subpixel: bool = False):
        if frames_per_call < 1:
            raise ValueError(f"frames_per_call must be at least 1; got {frames_per_call}")
        self.vae, self.dtype, self.channels_last = vae, dtype, channels_last
        self.frames_per_call = frames_per_call
        device = next(vae.parameters()).device
        self.mean = torch.tensor(vae.config.latents_mean, device=device, dtype=torch.float32)[:, None, None, None]
        self.std = torch.tensor(vae.config.latents_std, device=device, dtype=torch.float32)[:, None, None, None]
        self.first = True
        # replaced before the layouts are set, so its convolutions are laid out too
        self.upsamplings = subpixel_upsampling(vae.decoder) if subpixel else 0
        if channels_last:
            for module in vae.decoder.modules():
                if isinstance(module, torch.nn.Conv3d | torch.nn.Conv2d):
                    layout = torch.channels_last_3d if module.weight.dim() == 5 else torch.channels_last
                    module.weight.data = module.weight.data.contiguous(memory_format=layout)
        self.frame = torch.compile(self.eager_frame, dynamic=False) if compile else self.eager_frame

    def eager_frame(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        """Latent frames through the decoder in one call, its causal feature cache read and updated (``frame``
        is this, compiled where the decoder compiles)."""
        vae = self.vae
        vae._conv_idx = [0]
        return vae.decoder(x, feat_cache=vae._feat_map, feat_idx=vae._conv_idx, first_chunk=first)

    @property
    def device(self) -> torch.device:
        return self.mean.device

    def start_shot(self) -> None:
        self.vae.clear_cache()
        self.first = True

    def warm(self, channels: int, height: int, width: int, chunk_frames: int) -> None:
        """Every graph a video's chunks of ``chunk_frames`` latent frames meet (a shot's first chunk and two
        after it: the causal feature cache's layouts are steady from the third), compiled now on zeros and
        the feature cache cleared: compiling traces with FX, which patches every module's call in the
        process, so a decoder compiled in the decode thread while the DiT runs its next chunk fails
        there (torch 2.11: "Detected that you are using FX to symbolically trace a dynamo-optimized
        function")."""
        z = torch.zeros(channels, chunk_frames, height, width, device=self.device)
        self.start_shot()
        for _ in range(3):
            self.decode(z)
        self.start_shot()

    @torch.no_grad()
    def calls(self, z: torch.Tensor) -> Iterator[tuple[torch.Tensor, bool]]:
        """The decoder calls that ``decode`` makes of normalised latents (C, F, h, w): each call's input, laid
        out as the decoder takes it, and whether it is the shot's first call (the decoder counts as past its
        first call once that is yielded: a failed first call needs ``start_shot``)."""
        x = (z.to(self.device, torch.float32) * self.std + self.mean)[None].to(self.dtype)
        x = self.vae.post_quant_conv(x)  # a 1x1x1 convolution: no temporal state
        i = 0
        while i < x.shape[2]:
            first = self.first
            frames = x[:, :, i:i + (1 if first else self.frames_per_call)]
            if self.channels_last:
                frames = frames.contiguous(memory_format=torch.channels_last_3d)
            self.first = False
            yield frames, first
            i += frames.shape[2]

    @torch.no_grad()
    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Normalised latents (C, F, h, w) of the running shot -> (T, H, W, 3) uint8 frames:
        1 + 4 (F - 1) for the shot's first chunk, 4 F after it."""
        from diffusers.models.autoencoders.autoencoder_kl_wan import unpatchify

        out = torch.cat([self.frame(x, first) for x, first in self.calls(z)], dim=2)
        if self.vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        rgb = ((out.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        return rgb[0].permute(1, 2, 3, 0).contiguous()


class FrameStream:
    """Latent chunks in, frames out to ``write`` (one (H, W, 3) uint8 array at a time), in order.
    Asynchronous: ``put(z, new_shot)`` returns at once (blocking only while ``depth`` chunks wait);
    one thread decodes (on its own CUDA stream) and another writes, so neither the DiT nor the GPU
    waits for the CPU's video encoding. ``close()`` waits for the last frame. A failure in either
    thread is raised by the next call."""

    def __init__(self, decoder: ShotDecoder, write: Callable[[np.ndarray], None], asynchronous: bool = True,
                 depth: int = 2):
        self.decoder, self.write, self.asynchronous = decoder, write, asynchronous
        self.frames, self.decode_s = 0, 0.0
        self.error: BaseException | None = None
        cuda = decoder.device.type == "cuda"
        self.stream = torch.cuda.Stream(decoder.device) if asynchronous and cuda else None
        if asynchronous:
            self.latents: queue.Queue = queue.Queue(maxsize=depth)
            self.decoded: queue.Queue = queue.Queue(maxsize=depth)
            self.workers = [threading.Thread(target=self._decode_loop, name="vae-decode", daemon=True),
                            threading.Thread(target=self._write_loop, name="video-write", daemon=True)]
            for worker in self.workers:
                worker.start()

    def put(self, z: torch.Tensor, new_shot: bool) -> None:
        self._raise()
        if not self.asynchronous:
            self._write(self._decode(z, new_shot))
            return
        ready = None
        if z.device != self.decoder.device:  # the VAE on its own GPU (or the CPU): the latents move there now,
            z = z.to(self.decoder.device)  # a few MB, ordered after the DiT's work on them; the copy is z's own
        elif z.is_cuda:  # the decode stream waits for the DiT's work on z, and z is copied, not reused
            z = z.clone()
        if z.is_cuda:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(z.device))
        self.latents.put((z, new_shot, ready))

    def close(self) -> None:
        if self.asynchronous:
            self.latents.put(None)
            for worker in self.workers:
                worker.join()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("decoding or writing the frames failed") from self.error

    def _decode_loop(self) -> None:
        while (item := self.latents.get()) is not None:
            if self.error is not None:
                continue  # drain, so the producer never blocks on a dead worker
            z, new_shot, ready = item
            try:
                if self.stream is None:
                    self.decoded.put(self._decode(z, new_shot))
                    continue
                with torch.cuda.stream(self.stream):
                    self.stream.wait_event(ready)
                    self.decoded.put(self._decode(z, new_shot))
            except BaseException as e:  # noqa: BLE001 - handed to the producer's thread
                self.error = e
        self.decoded.put(None)

    def _write_loop(self) -> None:
        while (frames := self.decoded.get()) is not None:
            if self.error is not None:
                continue
            try:
                self._write(frames)
            except BaseException as e:  # noqa: BLE001 - handed to the producer's thread
                self.error = e

    def _decode(self, z: torch.Tensor, new_shot: bool) -> np.ndarray:
        start = time.perf_counter()
        if new_shot:
            self.decoder.start_shot()
        frames = self.decoder.decode(z).cpu().numpy()  # waits for this stream's decode only
        self.decode_s += time.perf_counter() - start
        return frames

    def _write(self, frames: np.ndarray) -> None:
        for rgb in frames:
            self.write(rgb)
        self.frames += len(frames)
