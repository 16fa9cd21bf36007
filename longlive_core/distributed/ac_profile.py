"""One block's forward and backward, op by op (the planner's input, ``ac_plan.BlockProfile``): each
aten op's id, the new storage its outputs hold, its time, and whether the backward reads it.

Ops are named the way the selective-checkpointing policy names them when it applies a plan
(``OpCounter``): the op overload and how many of it came before in the block's forward, counting
only ops with a floating-point tensor input. Index arithmetic and masks (a per-sample cross-attention
mask, FlexAttention's block mask built on a block's first call) are left out of the count, so they
do not shift the ids of the ops that matter; they are never saved.

Bytes are counted by storage: an output that is a view of an input, a parameter or an earlier output
costs nothing; an op's cost is the storage it creates, all of its outputs' (selective checkpointing
keeps them all). The backward's reads are the storages ``saved_tensors_hooks`` sees packed. An op
whose storage a later op writes in place is not savable (selective checkpointing refuses a cached
tensor that changed). Times: on CUDA each op between two events after a synchronize (the first pass
is a warm-up: lazy initialisation, autotuning); on the CPU with ``perf_counter`` (for tests only).
Each op also names the counted ops that made its arguments' storage (a view reads its base's
maker), from which the compiled plan is priced (``BlockProfile.recomputed_s``).
Work that does not go through the dispatcher (a Triton kernel launched from Python) is invisible
here: its time is counted nowhere and its outputs, made by an uncounted ``empty``, are never saved.
"""
from __future__ import annotations

import collections
import functools
import statistics
import time
from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
import torch.utils.checkpoint as checkpoint_module
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from longlive_core.distributed.ac_plan import BlockProfile, OpCost

# the ops selective checkpointing never asks its policy about (detach: a different count in forward
# and recomputation); the profile skips the same ones so that both count alike
IGNORED = getattr(checkpoint_module, "SAC_IGNORED_OPS", {torch.ops.aten.detach.default})


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class OpCounter:
    """Names the ops of one forward, in order: ``"<overload>#<k>"``, k counting that overload's earlier
    counted ops; None for an op that is not counted (no floating-point tensor input)."""

    def __init__(self):
        self.seen: collections.Counter = collections.Counter()

    def __call__(self, func, args, kwargs) -> str | None:
        if func in IGNORED or not any(t.is_floating_point() for t in _tensors((args, kwargs))):
            return None
        name = str(func)
        k = self.seen[name]
        self.seen[name] += 1
        return f"{name}#{k}"


class _Clock:
    """Times ops: CUDA events after a synchronize (read once the pass is over), or perf_counter."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        torch.cuda.synchronize()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, start):
        if not self.cuda:
            return time.perf_counter() - start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return start, end

    def seconds(self, mark) -> float:
        if not self.cuda:
            return mark
        start, end = mark
        return start.elapsed_time(end) / 1000.0


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments an op writes in place (its schema's mutable aliases)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        out += _tensors(value)
    return out


class _Recorder(TorchDispatchMode):
    """Records every op of a forward without keeping any tensor alive (storages by weak reference)."""

    def __init__(self, known: set[StorageWeakRef], clock: _Clock):
        super().__init__()
        self.known, self.clock = known, clock
        self.counter = OpCounter()
        self.ops: list[dict] = []  # id, bytes, time mark, own storages, savable
        self.creator: dict[StorageWeakRef, int] = {}  # storage -> index of the op that made it
        self.read: set[StorageWeakRef] = set()  # storages the backward saved

    @classmethod
    def ignore_compile_internals(cls) -> bool:  # as selective checkpointing's modes: compiled code is one op
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op_id = self.counter(func, args, kwargs)
        deps = {self.creator.get(StorageWeakRef(t.untyped_storage())) for t in _tensors((args, kwargs))}
        mark = self.clock.start()
        out = func(*args, **kwargs)
        mark = self.clock.stop(mark)
        for t in _written(func, args, kwargs):
            made_by = self.creator.get(StorageWeakRef(t.untyped_storage()))
            if made_by is not None:
                self.ops[made_by]["savable"] = False
        own, nbytes = [], 0
        for t in _tensors(out):
            ref = StorageWeakRef(t.untyped_storage())
            if ref in self.known or ref in self.creator:
                continue
            self.creator[ref] = len(self.ops)
            own.append(ref)
            nbytes += t.untyped_storage().nbytes()
        self.ops.append({"id": op_id, "bytes": nbytes, "mark": mark, "own": own, "savable": bool(own),
                         "deps": sorted(deps - {None})})
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.read.add(StorageWeakRef(t.untyped_storage()))
        return t


def _backward(out) -> None:
    outs = [t for t in _tensors(out) if t.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def profile_block(block: torch.nn.Module, args: tuple, kwargs: Mapping | None = None,
                  costs: Mapping[str, float] | None = None) -> BlockProfile:
    """One forward and backward of ``block(*args, **kwargs)`` (after one of warm-up), recorded op by
    op; ``costs`` (op id -> seconds) replaces measured times (tests). The block's gradients and the
    inputs' are left as they were; the caller keeps the global RNG apart if the backward draws from
    it (``torch.random.fork_rng``)."""
    kwargs = dict(kwargs or {})
    params = [p for p in block.parameters()]
    device = params[0].device if params else _tensors(args)[0].device
    grads = [(t, t.grad) for t in params + _tensors((args, kwargs)) if t.requires_grad]
    _backward(block(*args, **kwargs))
    known = {StorageWeakRef(t.untyped_storage())
             for t in _tensors((args, kwargs)) + params + list(block.buffers())}
    clock = _Clock(device)
    recorder = _Recorder(known, clock)
    if clock.cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t), recorder:
        out = block(*args, **kwargs)
    _backward(out)
    del out
    transient = 0
    if clock.cuda:
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - base
    for t, g in grads:
        t.grad = g
    costs = dict(costs or {})
    ops, forward = [], 0.0
    counted: dict[int, int] = {}  # the recorder's op index -> the profile's (uncounted ops are never saved)
    for k, op in enumerate(recorder.ops):
        seconds = costs.get(op["id"], clock.seconds(op["mark"])) if op["id"] is not None else clock.seconds(op["mark"])
        forward += seconds
        if op["id"] is not None:
            counted[k] = len(ops)
            ops.append(OpCost(op["id"], op["bytes"], seconds, any(r in recorder.read for r in op["own"]),
                              op["savable"], tuple(counted[d] for d in op["deps"] if d in counted)))
    if not clock.cuda:
        transient = sum(op.bytes for op in ops)
    first = _tensors(args)[0]
    return BlockProfile(tuple(ops), forward, first.untyped_storage().nbytes(), transient, str(device))


def forward_transient(block: torch.nn.Module, args: tuple) -> int | None:
    """On CUDA, the most one forward of ``block(*args)`` without gradients adds at once, its output
    included (what a no-grad pass through the model runs beside what a step holds: distill_dmd's
    scores over the generator's kept activations); None elsewhere (no allocator statistics)."""
    device = _tensors(args)[0].device
    if device.type != "cuda":
        return None
    with torch.no_grad():
        block(*args)  # lazy initialisation, autotuning
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        block(*args)
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base


# the saved sets of the compiled trials under way, by number: a checkpoint's context_fn under compile
# is a function, or a partial of one over constants
_TRIALS: dict[int, frozenset[str]] = {}


def _trial_contexts(key: int):
    return checkpoint_module.create_selective_checkpoint_contexts(counted_policy(_TRIALS[key]))


class Trial(NamedTuple):
    kept: int  # the bytes a block's forward keeps for its backward
    transient: int  # the most its backward adds at once
    seconds: float  # its forward and backward (the median of a few)


PLAIN = None  # block_trial's ``saved`` for a block run without checkpointing: it keeps what autograd saves


def block_trial(block: torch.nn.Module, args: tuple, saved: tuple[str, ...] | None = (), compiled: bool = True,
                repeats: int = 10) -> Trial:
    """On CUDA, ``block(*args)`` checkpointed with the outputs of the ops ``saved`` names kept (none: as
    ``full``; ``PLAIN``: not checkpointed) and run as a step runs it: what its forward keeps, what its
    backward adds at once, and how long the two take.

    ``compiled``: compiled as a step compiles it. The compiled partitioner decides what a checkpointed
    block really keeps and when it recomputes, and fuses what it recomputes: the eager profile
    overprices all three (on the H200, 5B dims, 56,320 tokens: a floor ~4 GiB and a plan's kept bytes
    ~1.8x over the measured step). Compiles afresh (``torch._dynamo.reset``: the policy is read when
    the block is traced). Eager, the time is what the eager profile cannot price: selective
    checkpointing runs every op of the forward and of its recomputation through a Python dispatch mode
    (nothing saved: plain checkpointing, as ``full`` runs), which costs more than it spares where a
    pass is too small to keep the GPU busy (distill_dmd's rollout chunks, bench/RESULTS.md).

    The block's gradients and the inputs' are left as they were. The time is a median of ``repeats``:
    the fused share is the difference of two trials' times, and with 3 the same block's share came out
    0.20 and 0.77 in one process on the H200."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    grads = [(t, t.grad) for t in list(block.parameters()) + _tensors(args) if t.requires_grad]
    key = max(_TRIALS, default=-1) + 1
    _TRIALS[key] = frozenset(saved or ())
    try:
        if saved is PLAIN:
            run = block
        else:
            context = functools.partial(_trial_contexts, key) if saved or compiled else \
                checkpoint_module.noop_context_fn
            run = checkpoint_wrapper(block, context_fn=context, preserve_rng_state=False)
        if compiled:
            torch._dynamo.reset()
            run = torch.compile(run, dynamic=False)
        _backward(run(*args))  # compiles; eager: lazy initialisation, autotuning
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        out = run(*args)
        torch.cuda.synchronize()
        kept = torch.cuda.memory_allocated() - start - sum(t.untyped_storage().nbytes() for t in _tensors(out))
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _backward(out)
        del out
        torch.cuda.synchronize()
        transient = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(repeats):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            _backward(run(*args))
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1000.0)
    finally:
        _TRIALS.pop(key)
        for t, g in grads:
            t.grad = g
    return Trial(max(kept, 0), transient, statistics.median(times))


def counted_policy(saved: frozenset[str], matched: set[str] | None = None) -> Callable:
    """A selective-checkpointing policy that keeps the outputs of the ops ``saved`` names (ids as
    the profile gives them) and lets everything else be recomputed. Forward and recomputation count
    apart (older torch asks the policy again while recomputing; newer only in the forward).
    ``matched`` collects the saved ids the forward met: under compile the traced ops must carry the
    eager profile's ids, or the plan keeps less than it says."""
    counters = {False: OpCounter(), True: OpCounter()}

    def policy(ctx, func, *args, **kwargs):
        op_id = counters[bool(ctx.is_recompute)](func, args, kwargs)
        if op_id is not None and op_id in saved:
            if matched is not None and not ctx.is_recompute:
                matched.add(op_id)
            return checkpoint_module.CheckpointPolicy.MUST_SAVE
        return checkpoint_module.CheckpointPolicy.PREFER_RECOMPUTE

    return policy
