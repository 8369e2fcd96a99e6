"""The one frame codec of every channel: a 4-byte big-endian length, then the message.

At most MAX_FRAME (16 MiB) of message. `encode` and `read_frame` (asyncio) serve the front end;
`recv_frame`/`send_frame` (blocking) the job process; `FdFrameReader` and `send_frame(..., fds)`
the zygote, whose frames carry descriptors: the sender attaches them (SCM_RIGHTS) to the first
bytes of the frame they belong to, and the receiver keeps them in a FIFO until it decodes the
frame that declares them.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from collections import deque
from collections.abc import Sequence

MAX_FRAME = 16 * 1024 * 1024
RECV_BYTES = 256 * 1024
MAX_FDS_PER_READ = 64


class FrameError(Exception):
    pass


def encode(payload: bytes) -> bytes:
    if len(payload) > MAX_FRAME:
        raise FrameError(f"frame of {len(payload)} bytes is over {MAX_FRAME}")
    return struct.pack(">I", len(payload)) + payload


async def read_frame(reader: asyncio.StreamReader) -> bytes | None:
    """The next frame, or None at a clean end of stream."""
    try:
        header = await reader.readexactly(4)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise FrameError("stream ended inside a frame header") from exc
        return None
    (size,) = struct.unpack(">I", header)
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes is over {MAX_FRAME}")
    try:
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError as exc:
        raise FrameError("stream ended inside a frame") from exc


def recv_frame(sock: socket.socket) -> bytes | None:
    """Blocking read of one frame; None at a clean end of stream."""
    header = _recv_exactly(sock, 4)
    if header is None:
        return None
    (size,) = struct.unpack(">I", header)
    if size > MAX_FRAME:
        raise FrameError(f"frame of {size} bytes is over {MAX_FRAME}")
    body = _recv_exactly(sock, size)
    if body is None:
        raise FrameError("stream ended inside a frame")
    return body


def _recv_exactly(sock: socket.socket, size: int) -> bytes | None:
    chunks, got = [], 0
    while got < size:
        chunk = sock.recv(size - got)
        if not chunk:
            if got:
                raise FrameError("stream ended inside a frame")
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def send_frame(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    """Blocking write of one frame; `fds` ride (SCM_RIGHTS) on its first bytes, in one sendmsg."""
    data = encode(payload)
    sent = 0
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
    if sent < len(data):
        sock.sendall(data[sent:])


class FdFrameReader:
    """Blocking reader of frames that may carry descriptors (SCM_RIGHTS), on a stream socket.

    Received descriptors (close-on-exec) wait in a FIFO until the caller decodes the frame that
    declares them and `take_fds(n)` pops them; `close()` closes those nobody took.
    """

    def __init__(self, sock: socket.socket, max_fds: int = MAX_FDS_PER_READ) -> None:
        self._sock = sock
        self._max_fds = max_fds
        self._buf = bytearray()
        self._fds: deque[int] = deque()
        self._eof = False

    @property
    def pending_fds(self) -> int:
        return len(self._fds)

    def recv_frame(self) -> bytes | None:
        """The next frame, or None at a clean end of stream (FrameError inside a frame)."""
        while True:
            if len(self._buf) >= 4:
                (size,) = struct.unpack(">I", self._buf[:4])
                if size > MAX_FRAME:
                    raise FrameError(f"frame of {size} bytes is over {MAX_FRAME}")
                if len(self._buf) >= 4 + size:
                    body = bytes(self._buf[4 : 4 + size])
                    del self._buf[: 4 + size]
                    return body
            if self._eof:
                if self._buf:
                    raise FrameError("stream ended inside a frame")
                return None
            self._fill()

    def take_fds(self, count: int) -> list[int]:
        """The next `count` received descriptors (FrameError if fewer arrived)."""
        if count < 0 or count > len(self._fds):
            raise FrameError(f"the frame declares {count} descriptors; {len(self._fds)} arrived")
        return [self._fds.popleft() for _ in range(count)]

    def close(self) -> None:
        while self._fds:
            os.close(self._fds.popleft())

    def _fill(self) -> None:
        data, fds, flags, _ = socket.recv_fds(
            self._sock, RECV_BYTES, self._max_fds, socket.MSG_CMSG_CLOEXEC
        )
        self._fds.extend(fds)
        if flags & socket.MSG_CTRUNC:
            raise FrameError("descriptors were cut off (more than the reader takes at once)")
        if not data:
            self._eof = True
        self._buf += data
