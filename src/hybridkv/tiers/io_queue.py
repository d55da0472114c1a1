"""Background I/O threads with two priorities: reads first, then writes.

Tiers hand blocking file or socket work here so the engine thread never waits on a disk;
the work itself (os.read/write, zlib, sockets) releases the GIL.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future

READ, WRITE = 0, 1


class IOQueue:
    def __init__(self, threads: int = 2, name: str = "hybridkv-io"):
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        self._closed = False
        self.threads = threads
        for t in self._threads:
            t.start()

    def submit(self, priority: int, fn: Callable, *args) -> Future:
        if self._closed:
            raise RuntimeError("I/O queue is closed")
        future: Future = Future()
        self._queue.put((priority, next(self._seq), fn, args, future))
        return future

    def _run(self) -> None:
        while True:
            _, _, fn, args, future = self._queue.get()
            if fn is None:
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # reported to whoever waits on the future
                    future.set_exception(e)

    def close(self) -> None:
        """Finish everything queued, then stop the threads."""
        if self._closed:
            return
        self._closed = True
        for _ in self._threads:
            self._queue.put((WRITE + 1, next(self._seq), None, (), None))
        for t in self._threads:
            t.join()


class BatchItem:
    """One item of a batch future whose result is a list, answering like a Future.

    A real Future per item (a lock and a condition each, settled one by one) cost more than
    reading a small page: 2,000 of them doubled the time of a 64 MiB promotion."""

    __slots__ = ("batch", "index")

    def __init__(self, batch: Future, index: int):
        self.batch, self.index = batch, index

    def result(self, timeout: float | None = None):
        return self.batch.result(timeout)[self.index]

    def done(self) -> bool:
        return self.batch.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self.batch.exception(timeout)


def fan_out(batch: Future, n: int) -> list[BatchItem]:
    """Per-item futures for a batch future whose result is a list of n results."""
    return [BatchItem(batch, i) for i in range(n)]


def batches_of(futures) -> set[Future]:
    """The distinct futures behind ``futures``: a ``BatchItem``'s batch, else the future itself.
    Waiting on or polling these asks each batch once, not once per item."""
    return {getattr(f, "batch", f) for f in futures}


def outcomes(futures) -> list[tuple[bool, BaseException | None]]:
    """Did each finished job succeed (a truthy result)? A job that raised did not: its
    exception comes back for the caller to log, never raised. A ``BatchItem``'s batch is
    asked once for all its items (a finished Future still takes a lock per question)."""
    answers: dict[int, tuple[object, BaseException | None]] = {}
    out = []
    for future in futures:
        batch = getattr(future, "batch", None)
        source = future if batch is None else batch
        answer = answers.get(id(source))
        if answer is None:
            try:
                answer = answers[id(source)] = (source.result(), None)
            except Exception as e:
                answer = answers[id(source)] = (None, e)
        value, error = answer
        if error is None and batch is not None:
            value = value[future.index]
        out.append((error is None and bool(value), error))
    return out
