"""Structured logs: one JSON object per line, with job and worker ids where they apply."""

from __future__ import annotations

import json
import logging
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
