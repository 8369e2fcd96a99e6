"""Stand-ins for prometheus_client where it is not installed: metrics are counted nowhere."""

from __future__ import annotations

from typing import Any


class CollectorRegistry:
    pass


class _Metric:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def labels(self, *args: Any, **kwargs: Any) -> _Metric:
        return self

    def inc(self, amount: float = 1) -> None:
        pass

    def set(self, value: float) -> None:
        pass

    def observe(self, value: float) -> None:
        pass


Counter = Gauge = Histogram = _Metric


def start_http_server(*args: Any, **kwargs: Any) -> None:
    raise RuntimeError("--metrics-port needs the prometheus-client package")
