"""A prompt file's embedding in ``longlive generate``'s ``Generator``, side by side in one process: umT5
loaded from its folder onto the GPU for the file (``FileTextEncoder``: ``longlive generate``, one video
a process) against the encoder kept page-locked in host memory and copied to the GPU for the file
(``HostTextEncoder``: a Generator made with ``keep_text_encoder``, as evaluate's suite makes it). Each:
seconds from the call to the embeddings on the GPU, over the two-shot prompt file's prompts, repeated;
the kept encoder's one-time load (once a process) and the host memory it holds reported apart.

    python bench/prompt_embedding.py /tmp/llp/umt5 --max-length 512    # after generate_product.py make
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longlive_core.infer.text_encoder import FileTextEncoder, HostTextEncoder  # noqa: E402

PROMPTS = ["a red kite over the beach at dusk, waves rolling in",
           "The scene transitions. a lighthouse on the cliff, its beam sweeping the sea"]


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", help="a umT5 encoder folder (generate_product.py make's umt5/)")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    device = torch.device("cuda")

    def fresh() -> None:  # loaded for the file, let go after
        with FileTextEncoder(args.folder, args.max_length, device).on() as encoder:
            encoder.encode(PROMPTS)

    def kept_file() -> None:
        with kept.on() as encoder:
            encoder.encode(PROMPTS)

    fresh()  # the folder in the page cache and the kernels loaded, for both
    start = time.perf_counter()
    kept = HostTextEncoder(args.folder, args.max_length, device)
    load_s = time.perf_counter() - start  # what the caller waits for: page-locking goes on in its thread
    kept.wait_locked()
    pin_s = time.perf_counter() - start - load_s
    rows = {"loaded_per_file": [], "host_kept": []}
    for _ in range(args.repeats):  # interleaved: the machine's drift falls on both
        rows["loaded_per_file"].append(timed(fresh))
        rows["host_kept"].append(timed(kept_file))
    fresh_s, kept_s = (statistics.median(rows[k]) for k in ("loaded_per_file", "host_kept"))
    host = torch.cuda.host_memory_stats() if hasattr(torch.cuda, "host_memory_stats") else {}
    row = {"device": torch.cuda.get_device_name(), "loaded_per_file_s": rows["loaded_per_file"],
           "host_kept_s": rows["host_kept"], "speedup": fresh_s / kept_s, "host_kept_load_s": load_s,
           "host_kept_pin_s": pin_s, "host_bytes": sum(t.nbytes for t in kept.weights),
           "host_buffer_bytes": kept.buffer.bytes.nbytes,  # the page-locked buffer the weights are views of
           # torch's host allocator: nothing of the encoder's should be in it
           "host_allocator": {k: v for k, v in host.items() if "bytes" in k}}
    print(f"prompt file embedded: loaded for the file {fresh_s:.2f} s, kept on the host {kept_s:.2f} s "
          f"({fresh_s / kept_s:.2f}x; medians of {args.repeats}); the kept encoder's load {load_s:.1f} s once, then "
          f"{pin_s:.1f} s page-locking in its thread, "
          f"{row['host_bytes'] / 2**30:.2f} GiB of weights in a {row['host_buffer_bytes'] / 2**30:.2f} GiB page-locked "
          f"buffer", flush=True)
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
