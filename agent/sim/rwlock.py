"""The weight-update lock: in-flight samples read, a weight update writes.

Writer-preferring, as SGLang's ``model_update_lock``: once a writer waits, new readers queue
behind it, so a weight update is not starved by a steady stream of requests; the writer holds the
lock only after every reader that came before it has released.
"""

from __future__ import annotations

import asyncio


class ReaderWriterLock:
    """Writer-preferring reader/writer lock (SGLang's model_update_lock)."""

    def __init__(self) -> None:
        self.readers = 0
        self.writer = False  # a writer holds the lock or waits for readers to drain
        self.active = False  # a writer holds the lock
        self._no_writer = asyncio.Event()
        self._no_writer.set()
        self.drained = asyncio.Event()
        self.drained.set()

    async def acquire_read(self) -> None:
        while self.writer:
            await self._no_writer.wait()
        self.readers += 1
        self.drained.clear()

    def acquire_read_nowait(self) -> None:
        """Take a read lock when no writer holds or waits for the lock (the caller checked)."""
        self.readers += 1
        self.drained.clear()

    def release_read(self) -> None:
        self.readers -= 1
        if self.readers <= 0:
            self.readers = 0
            self.drained.set()

    async def acquire_write(self) -> None:
        while self.writer:
            await self._no_writer.wait()
        self.writer = True
        self._no_writer.clear()
        try:
            while self.readers:
                await self.drained.wait()
        except BaseException:
            self.release_write()
            raise
        self.active = True

    def release_write(self) -> None:
        self.writer = False
        self.active = False
        self._no_writer.set()

    @property
    def locked(self) -> bool:
        """SGLang's ``model_update_lock.is_locked()``: a reader holds it, or a writer does (not one that waits)."""
        return self.readers > 0 or self.active
