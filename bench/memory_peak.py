"""What is allocated at a step's peak, by the line of this project's code that allocated it: the
budget planner's predicted peak against the measured one, explained (``bench/train_step.py
--memory-peak``).

``torch.cuda.memory._record_memory_history`` keeps every allocation and free with its stack;
``torch.cuda.memory._snapshot()`` returns them (``device_traces``) with what is allocated now
(``segments``). ``peak_allocations`` replays the trace: back from the end to what was live when
recording began, then forward to the moment the most was allocated, and sums what was live then by
the innermost frame under ``longlive_core/`` or ``bench/`` (allocations made before recording
carry no stack: "before recording"), and the stack of the allocation that made the peak. Nothing
is written but JSON: no pickle to load elsewhere.
"""
from __future__ import annotations

import collections
import json
from collections.abc import Mapping
from pathlib import Path

import torch

OURS = ("longlive_core/", "bench/")


def _where(frames) -> str:
    for frame in frames or ():
        if any(root in frame.get("filename", "") for root in OURS):
            return _short(frame)
    return "before recording" if not frames else "outside this project"


def peak_allocations(snapshot: Mapping, device: int = 0, top: int = 25) -> dict:
    """The peak of allocated bytes over the recorded trace of ``device`` and what was live then, the
    largest groups first."""
    live: dict[int, tuple[int, str]] = {}  # address -> (bytes, where)
    for segment in snapshot.get("segments", ()):
        if segment.get("device", device) != device:
            continue
        for block in segment.get("blocks", ()):
            if block.get("state") == "active_allocated":
                live[block["address"]] = (block["size"], _where(block.get("frames")))
    trace = [e for e in snapshot.get("device_traces", [[]] * (device + 1))[device]
             if e.get("action") in ("alloc", "free_completed")]
    for event in reversed(trace):  # back to the state when recording began
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        else:
            live[event["addr"]] = (event["size"], _where(event.get("frames")))
    total = sum(size for size, _ in live.values())
    peak, at_peak, made_by = total, dict(live), None
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _where(event.get("frames")))
            total += event["size"]
            if total > peak:
                peak, at_peak, made_by = total, dict(live), event
        else:
            size, _ = live.pop(event["addr"], (0, ""))
            total -= size
    groups: collections.Counter = collections.Counter()
    for size, where in at_peak.values():
        groups[where] += size
    return {"peak_gib": peak / 2**30,
            "at_peak": [{"where": where, "gib": round(size / 2**30, 3), "bytes": size}
                        for where, size in groups.most_common(top)],
            # where the step was when it peaked (the forward, a block's recomputation, the optimizer)
            "peak_made_by": [_short(frame) for frame in (made_by or {}).get("frames", ())[:16]]}


def _short(frame: Mapping) -> str:
    name = frame.get("filename", "")
    for root in (*OURS, "torch/"):
        if root in name:
            name = name[name.index(root):]
            break
    return f"{name}:{frame.get('line')} {frame.get('name', '')}"


def record_peak(run, path: Path) -> float:
    """``run()`` (one training step) with every CUDA allocation recorded; what was live at its peak
    written to ``path`` as JSON (``peak_allocations``). Returns the peak in GiB."""
    # Python stacks only: the report reads this project's Python frames, and a C++ stack costs an unwind per
    # allocation. Stacks of allocations only: a free's stack is not where its memory was made, and gathering one
    # while torch.utils.checkpoint stops a recomputation early (it raises to do so) is the likely cause of losing
    # that exception ("Block.forward returned NULL without setting an exception", the 16-block DMD budget step)
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, context="alloc", stacks="python")
    try:
        run()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    report = peak_allocations(snapshot, torch.cuda.current_device())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1))
    return report["peak_gib"]
