"""A small executor interface for per-item work (per video, per shot).

Stages hand a top-level function and a list of items to ``Executor.map_unordered`` and get back
``(item, result)`` pairs as they finish, where a result is either the function's return value or
the exception it raised: one failing item never stops the others. ``local`` runs worker
processes on this machine; the orchestration issue adds Ray or Dask executors behind the same
interface. The per-item functions know nothing about processes.
"""
from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Protocol, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Executor(Protocol):
    def map_unordered(self, fn: Callable[[T], R], items: Iterable[T]) -> Iterator[tuple[T, R | BaseException]]: ...


class InlineExecutor:
    """Runs items one after another in this process (workers: 1; handy under a debugger)."""

    def map_unordered(self, fn, items):
        for item in items:
            try:
                yield item, fn(item)
            except Exception as exc:  # noqa: BLE001 - reported per item, never swallowed
                yield item, exc


class LocalProcessExecutor:
    """Worker processes on this machine. "spawn" keeps workers free of the parent's threads and
    locks (PyAV, MLflow and torch all start threads).

    At most ``2 * workers`` items are in flight, and a result is let go as soon as it is yielded:
    a video's clips are megabytes, and holding every finished one until the end grows without bound.
    """

    def __init__(self, workers: int):
        self.workers = workers

    def map_unordered(self, fn, items):
        ctx = multiprocessing.get_context("spawn")
        pending = iter(items)
        with ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx) as pool:
            running: dict = {}

            def top_up() -> None:
                while len(running) < 2 * self.workers:
                    item = next(pending, _END)
                    if item is _END:
                        return
                    running[pool.submit(fn, item)] = item

            top_up()
            while running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in finished:
                    item = running.pop(fut)
                    exc = fut.exception()
                    if isinstance(exc, BrokenProcessPool):
                        # the pool is gone, not this item's fault: stop rather than blame every item
                        raise RuntimeError(f"a worker process died ({exc}); finished items are kept, "
                                           "rerun to continue") from exc
                    result = exc if exc is not None else fut.result()
                    del fut  # the future holds the result too
                    yield item, result
                    del result
                top_up()


_END = object()


def make_executor(kind: str, workers: int) -> Executor:
    if kind != "local":
        raise ValueError(f"executor {kind!r} is not available; use 'local'")
    return InlineExecutor() if workers <= 1 else LocalProcessExecutor(workers)
