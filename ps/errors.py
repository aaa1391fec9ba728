"""The PS error tree. Domain code raises these; the servicer maps each class to one
gRPC status code, and the client maps codes back, through one two-way table (``ps.wire.ERRORS``)."""
from __future__ import annotations

__all__ = ["PSError", "InvalidArgumentError", "ShapeMismatchError", "DtypeError", "NonFiniteError", "MalformedMessageError",
           "WrongShardError", "TableNotFoundError", "TableExistsError", "ResourceExhaustedError", "ShardUnavailableError",
           "DeadlineExceededError", "FailedPreconditionError", "InternalError", "UnauthenticatedError",
           "PermissionDeniedError", "with_table"]


class PSError(Exception):
    """Base of every error the PS raises."""


class InvalidArgumentError(PSError):
    """The request is wrong in itself (INVALID_ARGUMENT)."""


class ShapeMismatchError(InvalidArgumentError):
    """A tensor's shape does not match the table."""


class DtypeError(InvalidArgumentError):
    """A tensor's dtype is not accepted."""


class NonFiniteError(InvalidArgumentError):
    """A gradient holds NaN or Inf and the table rejects non-finite values."""


class MalformedMessageError(InvalidArgumentError):
    """Bytes that do not decode: truncated tensor data, broken protobuf."""


class WrongShardError(InvalidArgumentError):
    """A row or range was sent to a shard that does not own it."""


class TableNotFoundError(PSError):
    """No table of that name on the shard (NOT_FOUND)."""


class TableExistsError(PSError):
    """A table of that name exists with a different spec (ALREADY_EXISTS)."""


class ResourceExhaustedError(PSError):
    """Request or table larger than the shard's limits (RESOURCE_EXHAUSTED)."""


class ShardUnavailableError(PSError):
    """A shard could not be reached after retries (UNAVAILABLE)."""


class DeadlineExceededError(PSError):
    """A call did not finish within its deadline (DEADLINE_EXCEEDED)."""


class FailedPreconditionError(PSError):
    """The request is well formed but the system is not in a state to run it (FAILED_PRECONDITION),
    e.g. a BSP push for a clock the table has not reached."""


class InternalError(PSError):
    """A bug or an unexpected failure on the shard (INTERNAL)."""


def with_table(table: str, exc: PSError) -> PSError:
    """``exc`` with its message prefixed by ``table 'NAME': `` unless it already names the table."""
    return exc if f"table {table!r}" in str(exc) else type(exc)(f"table {table!r}: {exc}")


class UnauthenticatedError(PSError):
    """No credentials, or unknown ones (UNAUTHENTICATED)."""


class PermissionDeniedError(PSError):
    """The caller's identity may not do this (PERMISSION_DENIED)."""
