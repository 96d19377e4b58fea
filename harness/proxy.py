"""A TCP proxy for partition tests: forwards byte streams until told to stop, then heals.

    proxy = TcpProxy("127.0.0.1", coordinator_port)   # listens on proxy.address
    proxy.partition()   # nothing crosses any more, in either direction
    proxy.heal()        # forwarding resumes

A partition behaves like a network that silently stops delivering packets
(not like a reset): open connections stay open on both sides, bytes sent
meanwhile wait in the proxy and the kernel buffers, and connection attempts
are accepted but not forwarded. When the link heals, whatever was held is
delivered late, in order, so the far side sees the stale messages a real
partition produces (e.g. receipts and heartbeats of a session it has since
fenced). Peers that gave up on a connection meanwhile simply close it.

It runs an asyncio loop on a private daemon thread so blocking test code can
drive it; ``close()`` ends the thread and every connection.
"""

from __future__ import annotations

import asyncio
import threading


class TcpProxy:
    def __init__(self, target_host: str, target_port: int, listen_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcp-proxy", daemon=True)
        self._thread.start()
        self._open = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0
        self.bytes_forwarded = 0
        self._server = self._call(self._start(listen_host))
        self.port = self._server.sockets[0].getsockname()[1]
        self.address = f"tcp://{listen_host}:{self.port}"

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _start(self, host: str):
        self._open.set()
        return await asyncio.start_server(self._handle, host, 0)

    # ------------------------------------------------------------ control

    @property
    def partitioned(self) -> bool:
        return not self._open.is_set()

    def partition(self) -> None:
        self._loop.call_soon_threadsafe(self._open.clear)

    def heal(self) -> None:
        self._loop.call_soon_threadsafe(self._open.set)

    def close(self) -> None:
        if self._loop.is_closed():
            return

        async def shutdown():
            self._server.close()
            for w in list(self._writers):
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        try:
            self._call(shutdown())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()

    # ------------------------------------------------------------ forwarding

    async def _handle(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(down_w)
        up_w = None
        try:
            await self._open.wait()  # a connection attempt during a partition goes nowhere yet
            try:
                up_r, up_w = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._writers.add(up_w)
            await asyncio.gather(self._pump(down_r, up_w), self._pump(up_r, down_w))
        finally:
            for w in (down_w, up_w):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                await self._open.wait()
                data = await reader.read(65536)
                if not data:
                    break
                await self._open.wait()  # read just before a partition: hold it until the heal
                writer.write(data)
                await writer.drain()
                self.bytes_forwarded += len(data)
        except (ConnectionError, OSError):
            pass
        finally:
            # One side closed: close the other so the peers see the same.
            writer.close()
