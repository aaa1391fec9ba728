"""The two-way error table over a real gRPC call: the client raises the class the server raised,
also where two classes share a status code (federated ConfigError and TaskClosedError are both
FAILED_PRECONDITION; the client used to turn a ConfigError into a TaskClosedError)."""
from __future__ import annotations

import grpc
import pytest

from federated.errors import ConfigError, TaskClosedError, UnknownTaskError
from federated.wire import ERRORS as FED
from ps.errors import ShapeMismatchError, TableNotFoundError
from ps.wire import ERRORS as PS
from tessera.service import ErrorTable, ServerSecurity, build_server, client_channel


@pytest.mark.parametrize(
    "table,exc,want",
    [
        (FED, ConfigError("bad config"), ConfigError),
        (FED, TaskClosedError("task closed"), TaskClosedError),
        (FED, UnknownTaskError("no such task"), UnknownTaskError),
        (PS, TableNotFoundError("table 'x' not found"), TableNotFoundError),
        (PS, ShapeMismatchError("table 'x': wrong shape"), None),  # a subclass: the client gets its base
    ],
)
def test_the_client_raises_what_the_server_raised(table: ErrorTable, exc: Exception, want: type | None) -> None:
    def fail(request: bytes, context: grpc.ServicerContext) -> bytes:
        table.abort(context, exc, str(exc))
        return b""

    handler = grpc.method_handlers_generic_handler("t.T", {"M": grpc.unary_unary_rpc_method_handler(fail)})
    server, port, _ = build_server((handler,), "127.0.0.1", 0, ServerSecurity())
    try:
        channel = client_channel(f"127.0.0.1:{port}")
        with pytest.raises(grpc.RpcError) as e:
            channel.unary_unary("/t.T/M")(b"", timeout=5)
        cls, code, details = table.exception_of(e.value)
        assert code == table.code_of(exc) and details == str(exc)
        assert cls is (want or table.error_of(code))
        channel.close()
    finally:
        server.stop(0)
