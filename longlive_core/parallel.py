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
from concurrent.futures import ProcessPoolExecutor, as_completed
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
    locks (PyAV, MLflow and torch all start threads)."""

    def __init__(self, workers: int):
        self.workers = workers

    def map_unordered(self, fn, items):
        items = list(items)
        if not items:
            return
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx) as pool:
            futures = {pool.submit(fn, item): item for item in items}
            for fut in as_completed(futures):
                exc = fut.exception()
                if isinstance(exc, BrokenProcessPool):
                    # the pool is gone, not this item's fault: stop rather than blame every item
                    raise RuntimeError(f"a worker process died ({exc}); finished items are kept, "
                                       "rerun to continue") from exc
                yield futures[fut], (exc if exc is not None else fut.result())


def make_executor(kind: str, workers: int) -> Executor:
    if kind != "local":
        raise ValueError(f"executor {kind!r} is not available; use 'local'")
    return InlineExecutor() if workers <= 1 else LocalProcessExecutor(workers)
