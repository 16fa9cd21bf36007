"""Where the host time of one eager NVFP4 linear step (forward + backward) goes: each library
function the layer calls is wrapped with a timer (inclusive time, nested calls counted in their
callers too), steps are issued back to back behind a long GPU sleep (so no call waits for the GPU),
and the table gives microseconds per step. For reading, not for RESULTS ratios.

    PYTHONPATH=. python3 bench/tools/linear_host_split.py [--in 3072 --out 3072 --tokens 16384]
"""
from __future__ import annotations

import collections
import functools
import time

import torch
from linear_host import layer_step  # this folder is the script's, so first on sys.path

from longlive_core.quant import cublas, gemm, linear, triton_kernels, triton_launch

SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU clock: longer than the steps take to issue
STEPS = 20  # ~30 launches a step: well inside the device's launch queue

spent: dict[str, float] = collections.defaultdict(float)
calls: dict[str, int] = collections.Counter()


def timed(name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t0
            calls[name] += 1
    return wrapper


def instrument() -> None:
    for module, names in ((linear, ("quantize_partial", "operand_amaxes", "emulated_mm", "_pad_rows", "sqnr_db")),
                          (triton_kernels, ("_launch", "_device_seed", "_global_amax", "_amaxes")),
                          (gemm, ("float32_scalar",)), (cublas, ("scaled_mm_unchecked",))):
        for name in names:
            setattr(module, name, timed(f"{module.__name__.rsplit('.', 1)[-1]}.{name}", getattr(module, name)))
    fn = linear._NVFP4LinearFn
    fn.forward = staticmethod(timed("Function.forward", fn.forward))
    fn.backward = staticmethod(timed("Function.backward", fn.backward))
    launch = triton_launch.CachedLaunch.launch
    triton_launch.CachedLaunch.launch = timed("CachedLaunch.launch", launch)


def main() -> None:
    layer, x, _, step = layer_step()
    k, n, tokens = layer.in_features, layer.out_features, x.shape[0]
    for _ in range(5):
        step()
    instrument()
    for _ in range(3):  # the wrappers' first calls
        step()
    torch.cuda.synchronize()
    spent.clear()
    calls.clear()
    torch.cuda._sleep(SLEEP_CYCLES)
    t0 = time.perf_counter()
    for _ in range(STEPS):
        step()
    total = time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"# {k} -> {n}, {tokens} tokens: {1e6 * total / STEPS:.0f} us of host time per step "
          f"(issued behind a GPU sleep; inclusive times, nested calls also count in their callers)")
    print("| function | calls/step | us/step | us/call |")
    print("|---|---|---|---|")
    for name, t in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"| {name} | {calls[name] / STEPS:g} | {1e6 * t / STEPS:.0f} | {1e6 * t / calls[name]:.1f} |")


if __name__ == "__main__":
    main()
