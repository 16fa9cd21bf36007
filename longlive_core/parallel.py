"""A small executor interface for per-item work (per video, per shot).

Stages hand a top-level function and a list of items to ``Executor.map_unordered`` and get back
``(item, result)`` pairs as they finish, where a result is either the function's return value or
the exception it raised: one failing item never stops the others. ``local`` runs worker
processes on this machine; ``dask`` runs the items on a Dask cluster (a local one of the stage's
workers, or the scheduler at params ``dask.address``). The per-item functions know nothing about
processes; one that needs a device of its own asks ``worker_slot()`` which worker it runs on.
"""
from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Protocol, TypeVar

from longlive_core.config import ConfigError, from_mapping

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


_SLOT: int | None = None


def worker_slot() -> int:
    """This process's index among its executor's workers (0 outside a pool): the local executor
    numbers its workers 0..n-1, a local Dask cluster names them so, and a remote Dask worker named
    ``<host>-<i>`` (``dask worker --nworkers N --name <host>``) is slot i. A worker that stands for one
    GPU (CUDA_VISIBLE_DEVICES set per worker, as dask-cuda does) sees that GPU as its first, whatever
    its slot: devices take the slot modulo the GPUs visible."""
    if _SLOT is not None:
        return _SLOT
    try:
        from distributed import get_worker

        name = get_worker().name
    except (ImportError, ValueError):  # no dask installed, or not inside a Dask worker
        return 0
    if isinstance(name, int):
        return name
    tail = str(name).rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def _number_worker(counter) -> None:
    global _SLOT
    with counter.get_lock():
        _SLOT = counter.value
        counter.value += 1


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
        counter = ctx.Value("i", 0)
        with ProcessPoolExecutor(max_workers=self.workers, mp_context=ctx, initializer=_number_worker,
                                 initargs=(counter,)) as pool:
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
EXECUTORS = ("local", "dask")


@dataclass(frozen=True)
class DaskConfig:
    """params `dask`: the cluster behind `executor: dask`. Where work runs changes no output, so no
    DVC stage lists it. Credentials (TLS certificates) come from Dask's own environment variables
    (DASK_DISTRIBUTED__COMM__TLS__...), never from params."""
    address: str = ""  # empty: a local cluster of the stage's workers; else the scheduler, tcp:// or tls://
    retries: int = 2  # times an item may lose its worker and run again (a standing scheduler: its own config)

    def validate(self, where: str) -> None:
        if self.retries < 0:
            raise ConfigError(f"{where}.retries must be >= 0")

    @classmethod
    def from_params(cls, params: dict) -> DaskConfig:
        return from_mapping(cls, params.get("dask"), "dask")  # where work runs: no stage's DVC param

    def remote(self, executor: str) -> bool:
        """Whether a stage with this ``executor`` runs its items on another machine's devices."""
        return executor == "dask" and bool(self.address)


def cluster_settings(retries: int) -> dict:
    """Dask settings the executor relies on, read by a scheduler and its nannies when they start (a
    local cluster's here; a standing cluster takes the same from infra/dask/distributed.yaml).

    Worker saturation 1.0: a worker holds only the item it runs, so one that dies takes no bystanders
    with it (every item on a dead worker counts one failure towards allowed-failures). No
    MALLOC_TRIM_THRESHOLD_ for the workers (Dask sets 65536): any value turns off glibc's adaptive
    mmap threshold, so every decoded frame is mmapped and faulted in afresh: 7x the page faults and
    half the speed of split_video (bench/RESULTS.md). Dask's thread limits (OMP_NUM_THREADS=1, ...)
    stay: a worker is one core's share."""
    return {"distributed.scheduler.allowed-failures": retries, "distributed.scheduler.worker-saturation": 1.0,
            "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None}


class DaskExecutor:
    """Items as tasks on a Dask cluster, results streamed back as they finish.

    A worker that dies loses only the items it was running: the scheduler runs them again on
    another worker (its nanny restarts the dead one), up to ``retries`` times per item, after which
    that item alone fails (KilledWorker). As with the local executor, at most ``2 * workers`` items
    are in flight and a result is released once yielded. ``resources`` (e.g. {"GPU": 1}) is what a
    task holds on its worker; workers declare theirs (``dask worker --resources GPU=1``).
    """

    def __init__(self, workers: int, cfg: DaskConfig = DaskConfig(), resources: dict[str, float] | None = None):
        self.workers, self.cfg, self.resources = workers, cfg, resources

    def _client(self):
        from dask.distributed import Client, LocalCluster

        if self.cfg.address:
            return Client(self.cfg.address), None
        cluster = LocalCluster(n_workers=self.workers, threads_per_worker=1, processes=True,
                               dashboard_address=None, resources=self.resources)
        return Client(cluster), cluster

    def map_unordered(self, fn, items):
        import dask
        import distributed  # noqa: F401 - registers distributed's config defaults, read below

        # A local cluster's nannies set the workers' variables in this process too: put back afterwards.
        saved = {k: os.environ.get(k) for k in dask.config.get("distributed.nanny.pre-spawn-environ")}
        with dask.config.set(cluster_settings(self.cfg.retries)):
            client, cluster = self._client()
        try:
            yield from self._stream(client, fn, items)
        finally:
            client.close()
            if cluster is not None:
                cluster.close()
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _stream(self, client, fn, items):
        from dask.distributed import as_completed

        limit = 2 * max(1, len(client.scheduler_info().get("workers", {})), self.workers)
        pending, running, done = iter(items), {}, as_completed()

        def top_up() -> None:
            while len(running) < limit:
                item = next(pending, _END)
                if item is _END:
                    return
                fut = client.submit(fn, item, pure=False, resources=self.resources)
                running[fut.key] = item
                done.add(fut)

        top_up()
        for fut in done:
            item = running.pop(fut.key)
            result = fut.exception() if fut.status == "error" else fut.result()
            fut.release()
            del fut
            yield item, result
            del result
            top_up()


def make_executor(kind: str, workers: int, dask_cfg: DaskConfig | None = None, gpu: bool = False) -> Executor:
    """``gpu``: each item holds one GPU (on Dask, a ``GPU`` resource its worker declares; locally,
    the items' code picks the GPU of its ``worker_slot``)."""
    if kind == "dask":
        return DaskExecutor(workers, dask_cfg or DaskConfig(), {"GPU": 1} if gpu else None)
    if kind != "local":
        raise ValueError(f"executor {kind!r} is not available; use one of {EXECUTORS}")
    return InlineExecutor() if workers <= 1 else LocalProcessExecutor(workers)
