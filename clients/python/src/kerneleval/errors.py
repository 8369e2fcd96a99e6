"""Typed exceptions for gRPC errors, with the google.rpc.Status details decoded: a BadRequest's
field violations and a RetryInfo's retry delay."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

_STATUS_DETAILS_KEY = "grpc-status-details-bin"


@dataclass(frozen=True)
class FieldViolation:
    """One bad field of a request, e.g. field="spec.kernel.io.args[0].tensor.shape"."""

    field: str
    description: str

    def __str__(self) -> str:
        return f"{self.field}: {self.description}"


class KernelEvalError(Exception):
    """An RPC failed. `code` is the gRPC status code; `details` its message; `retry_delay` the
    seconds the server asked the client to wait before trying again (google.rpc.RetryInfo),
    None when it said nothing."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(
        self,
        details: str,
        *,
        code: grpc.StatusCode | None = None,
        field_violations: list[FieldViolation] | None = None,
        retry_delay: float | None = None,
    ) -> None:
        if code is not None:
            self.code = code
        self.details = details
        self.field_violations: list[FieldViolation] = list(field_violations or [])
        self.retry_delay = retry_delay
        super().__init__(self._message())

    def _message(self) -> str:
        """The code, the message and each field violation the message does not say already
        (the service's message lists the first few)."""
        text = f"{self.code.name}: {self.details}"
        for v in self.field_violations:
            if str(v) not in self.details:
                text += f"\n  {v}"
        return text


class InvalidArgument(KernelEvalError):
    """The request was rejected before anything was queued; see `field_violations`."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KernelEvalError):
    code = grpc.StatusCode.NOT_FOUND


class Unauthenticated(KernelEvalError):
    """An operations call without a valid admin token."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KernelEvalError):
    code = grpc.StatusCode.PERMISSION_DENIED


class ResourceExhausted(KernelEvalError):
    """The queue is full (or a message is too large); retry later (after `retry_delay`, when
    the server gave one). `Client.submit` retries it by itself within its `retry_timeout`."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(KernelEvalError):
    """The server cannot be reached or is shutting down."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(KernelEvalError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(KernelEvalError):
    code = grpc.StatusCode.CANCELLED


class FailedPrecondition(KernelEvalError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class AlreadyExists(KernelEvalError):
    code = grpc.StatusCode.ALREADY_EXISTS


class Unimplemented(KernelEvalError):
    code = grpc.StatusCode.UNIMPLEMENTED


class Internal(KernelEvalError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KernelEvalError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        NotFound,
        Unauthenticated,
        PermissionDenied,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        FailedPrecondition,
        AlreadyExists,
        Unimplemented,
        Internal,
    )
}


def _parse_status(raw: bytes) -> status_pb2.Status | None:
    status = status_pb2.Status()
    try:
        status.ParseFromString(raw)
    except Exception:  # a malformed trailer must not hide the original error
        return None
    return status


def violations_from_status_bytes(raw: bytes) -> list[FieldViolation]:
    """Field violations of every google.rpc.BadRequest in a serialized google.rpc.Status."""
    status = _parse_status(raw)
    return _violations(status) if status is not None else []


def _violations(status: status_pb2.Status) -> list[FieldViolation]:
    out: list[FieldViolation] = []
    for detail in status.details:
        if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            out.extend(FieldViolation(v.field, v.description) for v in bad.field_violations)
    return out


def _retry_delay(status: status_pb2.Status) -> float | None:
    """Seconds of the first google.rpc.RetryInfo's retry_delay; None without one."""
    for detail in status.details:
        if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            info = error_details_pb2.RetryInfo()
            detail.Unpack(info)
            return max(0.0, float(info.retry_delay.ToNanoseconds()) / 1e9)
    return None


def _trailing_status(metadata: Any) -> status_pb2.Status | None:
    """The google.rpc.Status of a call's trailers (the grpc-status-details-bin entry), decoded
    as grpc_status.rpc_status.from_call does, for sync and asyncio errors alike, without its
    check that the status's message matches the call's (a mismatch must not hide details)."""
    for key, value in metadata or ():
        if key == _STATUS_DETAILS_KEY and isinstance(value, bytes):
            return _parse_status(value)
    return None


def from_rpc_error(error: grpc.RpcError) -> KernelEvalError:
    """The typed exception for a failed call (sync or asyncio)."""
    code_fn = getattr(error, "code", None)
    code = code_fn() if callable(code_fn) else grpc.StatusCode.UNKNOWN
    details_fn = getattr(error, "details", None)
    details = (details_fn() if callable(details_fn) else None) or str(error)
    trailing_fn = getattr(error, "trailing_metadata", None)
    status = _trailing_status(trailing_fn() if callable(trailing_fn) else None)
    cls = _BY_CODE.get(code, KernelEvalError)
    exc = cls(
        details,
        code=code,
        field_violations=_violations(status) if status is not None else [],
        retry_delay=_retry_delay(status) if status is not None else None,
    )
    exc.__cause__ = error
    return exc
