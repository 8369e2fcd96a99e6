"""Structured logs: one JSON object per line, with job and worker ids where they apply.

The watchdog, the zygotes and job processes before their job write plain-text lines to the
stderr they share; `child_stderr` gives them a pipe whose lines become records here, so that
the service's log, --log-file included, is JSON lines only.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time

# Fields a caller may pass through `extra=` that go into the JSON object.
_FIELDS = (
    "job_id",
    "worker_id",
    "device_index",
    "verdict",
    "client_tag",
    "event",
    "rpc",
    "open_ms",  # a timing window's OpenWindow round trip (jobs.py)
    "close_ms",
    "held_ms",
    "why",  # what a job's run said where the service acted on it (a re-run alone: its OOM)
    "gpus",  # the GPUs' memory holders, gate and processes then (waits.py Waits.gpus)
    "side",  # a job's process: its kernel's or its judge's (a footprint learned: gpu_use.py)
    "peak_mib",
    "footprint_mib",
)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in _FIELDS:
            value = getattr(record, name, None)
            if value is not None and value != "":
                out[name] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup(level: str, path: str = "") -> None:
    handler: logging.Handler = (
        logging.FileHandler(path) if path else logging.StreamHandler(sys.stderr)
    )
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


# The children's lines by their prefix (watchdog/src/log.cc, jobproc/zygote.py): logger, and
# whether the prefix is stripped. They are INFO: a watchdog "warning: ..." comes with a warning
# event too, which the front end logs at WARNING. A line of none of them (a traceback, a
# library's complaint) is logged as it is, at WARNING, by the watchdog's logger.
_CHILD_PREFIXES = (
    ("kerneleval-watchdog: ", "kerneleval.watchdog", True),
    ("kerneleval zygote: ", "kerneleval.zygote", True),
    ("kerneleval job process", "kerneleval.jobproc", False),
)
MAX_CHILD_LINE = 64 * 1024  # longer lines are cut
_forwarders: set[asyncio.Task[None]] = set()


def child_record(line: str) -> tuple[str, int, str]:
    """(logger, level, message) of one line a child wrote to its stderr."""
    for prefix, name, strip in _CHILD_PREFIXES:
        if line.startswith(prefix):
            return name, logging.INFO, line[len(prefix) :] if strip else line
    return "kerneleval.watchdog", logging.WARNING, line


async def _forward(reader: asyncio.StreamReader) -> None:
    while True:
        try:
            raw = await reader.readuntil(b"\n")
        except asyncio.IncompleteReadError as end:
            raw = end.partial  # the last line, without its newline; then EOF
        except asyncio.LimitOverrunError as over:  # the rest of the line comes as the next
            raw = (await reader.readexactly(over.consumed))[:MAX_CHILD_LINE] + b" [cut]"
        if not raw:
            return
        line = raw.decode(errors="replace").rstrip("\r\n")
        if line:
            name, level, message = child_record(line)
            logging.getLogger(name).log(level, "%s", message)


async def child_stderr() -> int:
    """The write end of a pipe whose lines are logged (pass it as a child's stderr, then close
    it). Not the child's own stderr pipe: asyncio's Process.wait() would wait for every holder
    of that, a job process stuck in the driver included."""
    read_fd, write_fd = os.pipe()
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=MAX_CHILD_LINE, loop=loop)
    try:
        await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader, loop=loop), os.fdopen(read_fd, "rb", 0)
        )
    except BaseException:
        os.close(write_fd)
        raise
    task = loop.create_task(_forward(reader))
    _forwarders.add(task)  # a task nobody holds may be collected before it ends
    task.add_done_callback(_forwarders.discard)
    return write_fd
