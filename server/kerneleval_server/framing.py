"""Length-prefixed frames: a 4-byte big-endian length, then the message (at most 16 MiB)."""

from __future__ import annotations

import asyncio
import socket
import struct

MAX_FRAME = 16 * 1024 * 1024


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
