"""A leaner host path for launching a Triton kernel that has already been compiled.

``fn[grid](*args, **kwargs)`` costs tens of microseconds of Python per call on the H200 machine's
CPU (bench/tools/launch_cost.py): Triton binds and specializes every argument, builds a string
cache key, checks the kernel's globals and, with its default (empty) launch-hook chains, builds
launch metadata and calls both hooks. The emulated NVFP4 linear launches about eight such kernels
per training step, so at its smallest Wan-5B shape (3072 -> 3072, 16K tokens) an eager step was
bound by this host time (bench/RESULTS.md, iteration 6).

:class:`CachedLaunch` keys compiled kernels by what Triton specializes on: per tensor its dtype and
16-byte alignment, per integer whether it is 1, divisible by 16 and in int32 (or int64) range,
the keyword arguments (constexprs and compile options) as given, the options Triton adds from its
knobs (debug, instrumentation mode) and the current device. A miss compiles (or finds) the kernel
through Triton's own ``fn.run``; a hit calls that CompiledKernel's launcher directly, with the
arguments in the order Triton passes them (every parameter, constexprs included). Every call goes
through ``fn[grid]`` instead while launch hooks, a stages-inspection hook or pre-run hooks are
registered (profilers, so they see what Triton gives them) and while torch.compile traces (it
knows Triton's launches, not this one).

The key must never be coarser than Triton's: with ``VERIFY`` set (the GPU selfcheck sets it),
every launch also asks Triton which kernel it would pick and raises if that is another object,
and ``selfcheck.check_cached_launch`` runs the variations above. Triton's check that a kernel's
global variables have not changed since compiling is skipped on hits: the kernels of this package
read only module constants. The launcher's calling convention is Triton 3.6's and 3.8's.
"""
from __future__ import annotations

from typing import Any

import torch

VERIFY = False  # also check every launch's kernel against Triton's own choice (selfcheck)
ENABLED = True  # False: every launch through Triton's fn[grid] (benches compare the two)


class CachedLaunchMismatch(RuntimeError):
    pass


def _tensor_token(t: torch.Tensor):
    return t.dtype, t.data_ptr() % 16 == 0


def _int_token(i: int):
    return int, i == 1, i % 16 == 0, -(2**31) <= i < 2**31, i < 2**63


# by exact type: a dict lookup per argument is most of the key's cost on a hit
_TOKENS = {torch.Tensor: _tensor_token, torch.nn.Parameter: _tensor_token, int: _int_token,
           bool: lambda b: (bool, b), float: lambda f: float}


def _token(arg: Any):
    token = _TOKENS.get(type(arg))
    if token is not None:
        return token(arg)
    for kind in (torch.Tensor, bool, int, float):  # subclasses; bool before int, as bool is an int
        if isinstance(arg, kind):
            return _TOKENS[kind](arg)
    raise TypeError(f"CachedLaunch takes tensors, ints, floats and bools positionally; got {type(arg).__name__}")


def _active(hook) -> bool:
    return hook is not None and bool(getattr(hook, "calls", True))  # Triton's HookChain: empty by default


def _resolved(kernel):
    return kernel.result() if hasattr(kernel, "result") else kernel  # Triton's async-compile mode


class CachedLaunch:
    """``launcher[grid](*args, **kwargs)`` as ``fn[grid](...)``: positional arguments are the
    kernel's leading parameters (tensors, ints, floats, bools), keyword arguments its remaining
    parameters (constexprs) and compile options. Under TRITON_INTERPRET=1 it is ``fn[grid]``."""

    def __init__(self, fn):
        from triton import knobs
        from triton.runtime.jit import JITFunction
        self.fn = fn
        self.compiled = isinstance(fn, JITFunction)  # False under the interpreter: nothing to cache
        self.params = [p.name for p in fn.params] if self.compiled else []
        # positional arguments are keyed by type only, so none may be a constexpr
        self._positional_max = next((i for i, p in enumerate(fn.params) if p.is_constexpr), len(self.params)) \
            if self.compiled else 0
        self._kernels: dict[tuple, tuple] = {}
        self._knobs = knobs
        self._device = self._stream = None

    def __getitem__(self, grid):
        if not self.compiled:
            return self.fn[grid]
        return lambda *args, **kwargs: self.launch(grid, args, kwargs)

    def _bypassed(self) -> bool:
        r = self._knobs.runtime
        return (_active(r.launch_enter_hook) or _active(r.launch_exit_hook)
                or getattr(r, "add_stages_inspection_hook", None) is not None
                or bool(getattr(self.fn, "pre_run_hooks", None)) or torch.compiler.is_compiling())

    def kernel_for(self, args: tuple, kwargs: dict):
        """(key, (CompiledKernel, trailing arguments)) for these arguments, compiling on a miss;
        None where Triton gives no kernel (a JIT cache hook that skips compiling)."""
        if self._device is None:
            from triton.runtime import driver
            self._device, self._stream = driver.active.get_current_device, driver.active.get_current_stream
        knobs = self._knobs
        key = (self._device(), tuple(map(_token, args)), tuple(kwargs.items()), knobs.runtime.debug,
               getattr(knobs.compilation, "instrumentation_mode", None))
        entry = self._kernels.get(key)
        if entry is None:
            trailing = self._trailing(len(args), kwargs)
            kernel = self.tritons_pick(args, kwargs)
            if kernel is None:
                return None
            kernel._init_handles()  # loaded before it is shared: another thread may launch it next
            entry = self._kernels[key] = (kernel, trailing)
        return key, entry

    def tritons_pick(self, args: tuple, kwargs: dict):
        """The kernel Triton's own launch would run for these arguments (compiling it if need be)."""
        return _resolved(self.fn.run(*args, grid=None, warmup=True, **kwargs))

    def launch(self, grid: tuple, args: tuple, kwargs: dict):
        found = None if not ENABLED or self._bypassed() else self.kernel_for(args, kwargs)
        if found is None:
            return self.fn[grid](*args, **kwargs)
        key, (kernel, trailing) = found
        if VERIFY and self.tritons_pick(args, kwargs) is not kernel:
            raise CachedLaunchMismatch(f"{repr(self.fn)}: the cached launch picked another kernel than "
                                       f"Triton for key {key}: its key is coarser than Triton's specialization")
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, self._stream(key[0]), kernel.function, kernel.packed_metadata, None, None, None,
                   *args, *trailing)
        return kernel

    def _trailing(self, n_positional: int, kwargs: dict) -> tuple:
        """The parameters after the positional ones, in the kernel's order (the launcher takes every
        parameter, constexprs included, and skips the constexprs itself)."""
        if n_positional > self._positional_max:
            raise TypeError(f"{repr(self.fn)}: CachedLaunch takes constexprs as keyword arguments; got "
                            f"{self.params[self._positional_max]!r} positionally")
        missing = [p for p in self.params[n_positional:] if p not in kwargs]
        if missing:
            raise TypeError(f"{repr(self.fn)}: CachedLaunch needs parameters {missing} as keyword arguments")
        return tuple(kwargs[p] for p in self.params[n_positional:])
