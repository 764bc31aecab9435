"""``AsyncDevice``: a small thread-safe device for tests, whose copies run later, on one
worker thread per stream, in their own time (a random delay per operation).

It implements pinstage's device seam (``pinstage._device.Backend``) over host memory, so the
staging arena, pools and fences run under real concurrency: a region reused before its copy
ran shows up as a wrong result, and an event recorded on the wrong stream as well. The backend
conformance suite (tests/test_backends.py) runs it beside the real backends.
"""

from __future__ import annotations

import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from pinstage._device import Backend, Probe

__all__ = ["AsyncDevice"]


class _Stream:
    """One in-order queue run by its own worker thread, with a random delay per operation."""

    def __init__(self, seed: int, max_delay_s: float) -> None:
        # ``with self.lock`` (a C-level lock: no Python ``__exit__`` an interrupt could skip);
        # the condition over it only for the worker's waits.
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)
        self.queue: deque[tuple[int, Callable[[], Any]]] = deque()
        self.queued = 0
        self.done = 0
        self.paused = False
        self.rng = random.Random(seed)
        self.max_delay_s = max_delay_s
        self.closed = False
        self.error: BaseException | None = None
        self.worker = threading.Thread(target=self._run, daemon=True)
        self.worker.start()

    def enqueue(self, fn: Callable[[], Any]) -> None:
        with self.lock:
            self.queued += 1
            self.queue.append((self.queued, fn))
            self.cond.notify_all()

    def _run(self) -> None:
        while True:
            with self.lock:
                while not self.closed and (self.paused or not self.queue):
                    self.cond.wait(0.005)  # (a notify can be lost to an interrupt)
                if self.closed:
                    return
                seq, fn = self.queue[0]
            if self.max_delay_s:
                time.sleep(self.rng.random() * self.max_delay_s)
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.error = exc
            del fn  # (a device keeps no reference to what it read)
            with self.lock:
                self.queue.popleft()
                self.done = seq
                self.cond.notify_all()

    def wait(self, seq: int) -> None:
        # Polls (no Condition.wait: an interrupt inside it can leave its lock released)
        deadline = time.monotonic() + 30
        while self.done < seq:
            if time.monotonic() > deadline:
                raise AssertionError(f"device stream stuck: waiting for {seq}, done "
                                     f"{self.done}, queued {self.queued}, "
                                     f"{len(self.queue)} in the queue, paused {self.paused}")
            time.sleep(20e-6)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.cond.notify_all()


class AsyncDevice(Backend):
    """A device whose copies run later, on per-stream worker threads (thread-safe).

    Memory is host memory ("pinned" means registered here); ``current_stream()`` is per calling
    thread (``use_stream``). Events are ``[stream, sequence number]``: they fence that stream
    only."""

    name = "async-test"
    accelerator = True
    asynchronous = True

    def __init__(self, streams: int = 2, seed: int = 0, max_delay_s: float = 0.0002) -> None:
        self.device = torch.device("cpu")
        self.streams = [_Stream(seed + i, max_delay_s) for i in range(streams)]
        self._local = threading.local()
        self.records: list[int] = []  # stream of every recorded event
        self.registered: dict[int, int] = {}  # ptr -> size of "pinned" host memory

    # -- facts and memory --------------------------------------------------------------------
    def probe(self, alloc_pinned: Callable[[int], torch.Tensor]) -> Probe:
        return Probe(True, True, False, ("test device",))

    def register_host(self, ptr: int, size: int) -> None:
        self.registered[ptr] = size

    def unregister_host(self, ptr: int, size: int) -> None:
        self.registered.pop(ptr, None)

    def is_pinned(self, t: torch.Tensor) -> bool:
        ptr = t.data_ptr()
        return any(p <= ptr < p + n for p, n in list(self.registered.items()))

    def is_device_tensor(self, t: torch.Tensor) -> bool:
        return False

    def empty(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(tuple(shape), dtype=dtype, device="cpu")

    def zeros(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(tuple(shape), dtype=dtype, device="cpu")

    def uva_view(self, host: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the test device has no UVA views")

    # -- device work -------------------------------------------------------------------------
    def use_stream(self, i: int) -> None:
        self._local.stream = i

    def current_stream(self) -> int:
        return getattr(self._local, "stream", 0)

    def copy_h2d(self, dst: torch.Tensor, src: torch.Tensor, pinned: bool = False) -> None:
        self.streams[self.current_stream()].enqueue(lambda: dst.copy_(src))

    def copy_d2h(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.streams[self.current_stream()].enqueue(lambda: dst.copy_(src))

    def copy_d2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.streams[self.current_stream()].enqueue(lambda: dst.copy_(src))

    def launch(self, fn: Callable[..., Any], *args: Any) -> None:
        self.streams[self.current_stream()].enqueue(lambda: fn(*args))

    def synchronize(self) -> None:
        for s in self.streams:
            with s.lock:
                target = s.queued
            s.wait(target)

    def is_capturing(self) -> bool:
        return False

    def capture_underway(self, streams: Iterable[Any]) -> bool:
        return False

    def deferred_read_changed(self, message: str) -> Exception:
        return RuntimeError(message)

    # -- raw events --------------------------------------------------------------------------
    def new_event(self) -> list[int]:
        return [0, 0]

    def record_event(self, event: Any, stream: Any) -> None:
        s = self.streams[stream]
        with s.lock:
            self.records.append(stream)
            event[0], event[1] = stream, s.queued

    def event_done(self, event: Any) -> bool:
        s = self.streams[event[0]]
        with s.lock:
            return s.done >= event[1] or s.closed  # (closed: nothing more will run)

    def wait_event_host(self, event: Any) -> None:
        self.streams[event[0]].wait(event[1])

    # -- for tests ---------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the workers; the device does no more work, so its state is retired (as a
        simulator's is): later fences elsewhere never wait on this device's events."""
        for s in self.streams:
            s.close()
        from pinstage import _state

        _state.retire(self)

    def errors(self) -> list[BaseException]:
        return [s.error for s in self.streams if s.error is not None]
