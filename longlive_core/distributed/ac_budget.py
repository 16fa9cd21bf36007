"""``activation_checkpointing: budget`` as applied to a model: per-block selective checkpointing
whose policy is the plan (``ac_plan``) of the block's kind for the window the micro-batch has; the
memory limit it plans under; plans cached on disk by what they depend on.

Compiled blocks are wrapped as ``selective`` wraps them, with a context that reads the plan chosen
last (``use``). Before any plan, and for a window without one, nothing is saved: the step runs as
``full`` does. Eager blocks read the plan when they run: one that keeps nothing is checkpointed
plainly (selective checkpointing's dispatch mode costs every op time in Python), and a plan may run
the last blocks of a kind in their model without checkpointing at all (``plain``: the backward
reaches them first, so what they keep is freed before the other blocks recompute). Under compile
the policy is read when a block is traced, once per input shape; a window's shapes are its own, so
each window's compiled blocks keep that window's plan (on the CPU, torch 2.14, a compiled tiny
block's traced ops carry the eager profile's ids: every saved id was matched; not a test, compiling
is slow).
"""
from __future__ import annotations

import collections
import copy
import functools
import hashlib
import itertools
import json
import os
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from longlive_core.config import ConfigError
from longlive_core.distributed.ac_plan import FORMAT, ACPlan
from longlive_core.distributed.ac_profile import counted_policy
from longlive_core.io.atomic import atomic_path

DEFAULT_SHARE = 0.9  # of the device's memory, when the limit is not given


def block_kind(block: nn.Module) -> str:
    """Blocks with the same modules run the same ops (a BF16 block beside NVFP4 ones does not)."""
    layout = [(name, type(m).__name__) for name, m in block.named_modules()]
    layout += [(name, str(p.dtype), tuple(p.shape)) for name, p in block.named_parameters()]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:12]


# torch.compile takes a checkpoint's context_fn only as a function, or a partial of one over constants:
# the wrappers name their BudgetCheckpointing by number
_HOLDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NUMBERS = itertools.count()


def _contexts(holder: int, kind: str):
    return _HOLDERS[holder].contexts(kind)


def _eager_checkpoint(holder: int, kind: str, ordinal: int, block: nn.Module, *args, **kwargs):
    """An eager block of ``kind``, the ``ordinal``-th of its kind in its model, as the plan in use says."""
    return _HOLDERS[holder].run_eager(kind, ordinal, block, *args, **kwargs)


class BudgetCheckpointing:
    """The per-block policies of ``activation_checkpointing: budget`` and the plans they read:
    ``plans[window][kind]``. ``probes`` holds, per block kind, a copy of one block as it was before
    sharding, for the profiler."""

    def __init__(self):
        self.probes: dict[str, nn.Module] = {}
        self.counts: collections.Counter = collections.Counter()  # blocks of each kind
        self.plans: dict[int, dict[str, ACPlan]] = {}
        # per plan, the blocks of each kind (the last ones of their model) an eager step runs unchecked
        self.plain: dict[int, dict[str, int]] = {}
        self._saved: dict[str, frozenset[str]] = {}
        self._plain: dict[str, int] = {}
        self._ordinals: collections.Counter = collections.Counter()  # the blocks of each kind wrapped in a model
        self.per_model: dict[str, int] = {}  # the blocks of each kind in a model
        self.matched: dict[str, set[str]] = collections.defaultdict(set)  # saved ids a forward (or trace) met
        self.number = next(_NUMBERS)
        _HOLDERS[self.number] = self

    def contexts_for(self, block: nn.Module):
        """The ``context_fn`` of ``block``'s checkpoint wrapper (``parallelize.BlockCheckpointing``)."""
        return functools.partial(_contexts, self.number, self._register(block))

    def checkpoint_fn_for(self, block: nn.Module, index: int):
        """The ``checkpoint_fn`` of an eager ``block``'s wrapper, ``model.blocks[index]``, the blocks of a model
        given in order (``parallelize.BlockCheckpointing``)."""
        kind = self._register(block)
        if index == 0:  # another model: its blocks count from its first
            self._ordinals = collections.Counter()
        ordinal = self._ordinals[kind]
        self._ordinals[kind] += 1
        self.per_model[kind] = max(self.per_model.get(kind, 0), ordinal + 1)
        return functools.partial(_eager_checkpoint, self.number, kind, ordinal)

    def _register(self, block: nn.Module) -> str:
        kind = block_kind(block)
        if kind not in self.probes:
            # a sequence-parallel group is shared, not copied (NVFP4 layers reduce amaxes over it)
            groups = {id(v): v for m in block.modules() for v in vars(m).values()
                      if isinstance(v, dist.ProcessGroup)}
            self.probes[kind] = copy.deepcopy(block, memo=groups)
        self.counts[kind] += 1
        return kind

    def contexts(self, kind: str):
        """Selective checkpointing's two contexts for a block of ``kind`` under the plan in use."""
        return create_selective_checkpoint_contexts(counted_policy(self._saved.get(kind, frozenset()),
                                                                   self.matched[kind]))

    def run_eager(self, kind: str, ordinal: int, block: nn.Module, *args, **kwargs):
        """``block``, the ``ordinal``-th of its kind in its model, unchecked where the plan in use runs it
        so, checkpointed plainly where it keeps nothing, else under its selective-checkpointing policy."""
        if ordinal >= self.per_model[kind] - self._plain.get(kind, 0):
            return block(*args, **kwargs)
        context = functools.partial(self.contexts, kind) if self._saved.get(kind) else noop_context_fn
        return checkpoint(block, *args, use_reentrant=False, preserve_rng_state=False, context_fn=context, **kwargs)

    def matched_share(self, window: int) -> float | None:
        """Of ``window``'s saved op ids, the share some forward of a block met (None: nothing saved)."""
        saved = {(kind, op) for kind, plan in self.plans.get(window, {}).items() for op in plan.saved}
        if not saved:
            return None
        return sum(op in self.matched[kind] for kind, op in saved) / len(saved)

    def use(self, window: int | None) -> bool:
        """Blocks keep what ``window``'s plans say from now on; False (and nothing kept) without one
        (None: none)."""
        plans = self.plans.get(window)
        self._saved = {kind: frozenset(p.saved) for kind, p in plans.items()} if plans else {}
        self._plain = dict(self.plain.get(window, {})) if plans else {}
        return plans is not None


def require_limit(limit_gib: float | None, device: torch.device, key: str) -> None:
    """A limit is needed where there is no GPU memory to take a share of."""
    if limit_gib is None and device.type != "cuda":
        raise ConfigError(f"{key}: null means {DEFAULT_SHARE:g} of the GPU's memory, and this run is on the "
                          f"{device.type}: give the limit in GiB")


def memory_limit(limit_gib: float | None, device: torch.device, key: str) -> int:
    """The step's peak limit in bytes: ``limit_gib``, or ``DEFAULT_SHARE`` of the GPU's memory."""
    require_limit(limit_gib, device, key)
    if limit_gib is not None:
        return int(limit_gib * 2**30)
    return int(DEFAULT_SHARE * torch.cuda.get_device_properties(device).total_memory)


def margin_key(key: str) -> str:
    """The planning margin's key beside the limit's ``key`` (``<stage>.ac_memory_limit_gib``)."""
    return key.rpartition(".")[0] + ".ac_plan_margin_gib"


def plan_target(limit: int, margin_gib: float, key: str) -> tuple[int, int]:
    """(margin, target) in bytes: the plans aim ``margin_gib`` below ``limit``, the check holds ``limit``."""
    margin = int(margin_gib * 2**30)
    if margin >= limit:
        raise ConfigError(f"{margin_key(key)} ({margin_gib}) leaves the plan no room under the limit of "
                          f"{limit / 2**30:.2f} GiB")
    return margin, limit - margin


def check_peak(measured: int, limit: int, predicted: int | None, key: str, step: int, margin: int = 0) -> None:
    """A measured peak above the limit is an error that says by how much, and what to set: the limit is
    also what the plan aims for (less ``margin``), so a plan that fell short needs a margin, not a lower limit
    (which would lower this check's threshold with it)."""
    if measured <= limit:
        return
    short = measured - limit + margin if predicted is None else measured - predicted
    guess = "" if predicted is None else f"; the plan predicted {predicted / 2**30:.2f} GiB"
    raise ConfigError(f"{key}: step {step} peaked at {measured / 2**30:.2f} GiB, {(measured - limit) / 2**30:.2f} GiB "
                      f"above the limit of {limit / 2**30:.2f} GiB{guess}: set {margin_key(key)} to at least "
                      f"{max(short, measured - limit + margin) / 2**30:.2f} GiB (now {margin / 2**30:.2f}): the plan "
                      f"then aims that far below the limit")


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/longlive/ac-plans`` (``~/.cache`` when unset or relative, as the spec says)."""
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "longlive" / "ac-plans"


class PlanCache:
    """Plans and the profiles they came from, one JSON file per key (a mapping of everything the plan
    depends on: model dims, tokens, recipe, kernels, device, limit)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, key: dict) -> Path:
        return self.root / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")

    def get(self, key: dict) -> dict | None:
        path = self._path(key)
        try:
            entry = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        if entry.get("key") != json.loads(json.dumps(key)) or entry.get("format") != FORMAT:
            return None
        return entry["value"]

    def below(self, key: dict, field: str = "limit") -> list[tuple[float, dict]]:
        """(``field``'s value, entry) of every cached entry whose key is ``key`` but for a smaller
        ``field``."""
        want = json.loads(json.dumps(key))
        out = []
        for path in sorted(self.root.glob("*.json")):
            try:
                entry = json.loads(path.read_text())
                other = entry["key"]
                if entry.get("format") != FORMAT or other.keys() != want.keys() or other[field] >= want[field] \
                        or any(other[k] != v for k, v in want.items() if k != field):
                    continue
            except (OSError, ValueError, KeyError, TypeError, AttributeError):
                continue  # not a plan of this format (written by hand, or half a file from before atomic writes)
            out.append((other[field], entry["value"]))
        return out

    def put(self, key: dict, value: dict) -> None:
        with atomic_path(self._path(key)) as tmp:
            tmp.write_text(json.dumps({"format": FORMAT, "key": key, "value": value}, sort_keys=True))
