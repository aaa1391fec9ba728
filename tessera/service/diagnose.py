"""Why a connection fails: :func:`diagnose` probes a server the way a client would connect (TCP,
then a TLS handshake) and names the likely cause (:class:`Diagnosis`)."""
from __future__ import annotations

import contextlib
import socket
import ssl
from dataclasses import dataclass

from tessera.service.errors import ServiceError
from tessera.service.tls import ClientSecurity, pem_file, read_pem

__all__ = ["Diagnosis", "ServerUnreachableError", "diagnose"]


class ServerUnreachableError(ServiceError, TimeoutError):
    """:func:`wait_for_server` gave up: no connection within its timeout (the message says why;
    ``diagnosis`` is the last probe's finding)."""

    def __init__(self, message: str, diagnosis: "Diagnosis | None" = None) -> None:
        super().__init__(message)
        self.diagnosis = diagnosis


@dataclass(frozen=True)
class Diagnosis:
    """What a probe of a server found. ``kind``: ``ok`` (a TLS/plaintext handshake as the client
    would do it works), ``refused`` (nothing listening), ``unreachable`` (no answer, or the name
    does not resolve), or a security mismatch: ``tls_required``, ``tls_unsupported``,
    ``untrusted``, ``name_mismatch``, ``client_cert_required``. ``message``: one sentence with
    what to do."""

    kind: str
    message: str

    @property
    def mismatch(self) -> bool:
        """True for a transport-security mismatch (retrying cannot help)."""
        return self.kind in ("tls_required", "tls_unsupported", "untrusted", "name_mismatch", "client_cert_required")


def _host_port(address: str) -> tuple[str, int] | None:
    a = address.split("///", 1)[-1]
    for scheme in ("ipv4:", "ipv6:", "dns:"):
        if a.startswith(scheme):
            a = a[len(scheme):]
    host, sep, port = a.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]") or "localhost", int(port)


def diagnose(address: str, security: ClientSecurity | None = None, timeout: float = 2.0) -> Diagnosis:
    """Probe ``address`` the way a client with ``security`` would connect (TCP, then a TLS
    handshake) and say why a gRPC connection fails, if it can tell. Takes at most about
    2 x ``timeout`` seconds; never raises."""
    sec = security or ClientSecurity()
    hp = _host_port(address)
    if hp is None:
        return Diagnosis("unreachable", f"{address!r} is not HOST:PORT")
    host, port = hp
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return Diagnosis("refused", f"nothing is listening at {address} (connection refused)")
    except socket.gaierror as e:
        return Diagnosis("unreachable", f"cannot resolve {host!r}: {e.strerror}")
    except OSError as e:
        return Diagnosis("unreachable", f"no connection to {address}: {e.strerror or e}")
    tls_flags = "--tls-cert/--tls-key"
    try:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.set_alpn_protocols(["h2"])
        name = sec.server_name or host
        if sec.tls_ca:
            ctx.load_verify_locations(cadata=read_pem(sec.tls_ca).decode())
        else:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        with contextlib.ExitStack() as stack:
            if sec.tls_ca and sec.tls_cert and sec.tls_key:
                ctx.load_cert_chain(stack.enter_context(pem_file(sec.tls_cert)), stack.enter_context(pem_file(sec.tls_key)))
            try:
                tls = ctx.wrap_socket(sock, server_hostname=name)
            except ssl.SSLCertVerificationError as e:
                why = e.verify_message or str(e)
                if "hostname" in why.lower() or "ip address mismatch" in why.lower():
                    return Diagnosis(
                        "name_mismatch",
                        f"the certificate of the server at {address} is not valid for the name {name!r} ({why}): "
                        "connect by a name the certificate holds (tessera cert --hosts ...)",
                    )
                return Diagnosis(
                    "untrusted",
                    f"the server at {address} speaks TLS, but its certificate is not accepted by the CA given "
                    f"(--tls-ca): {why}; give the CA that signed the server's certificate",
                )
            except ssl.SSLError as e:
                reason = e.reason or ""
                if "CERTIFICATE_REQUIRED" in reason or ("HANDSHAKE_FAILURE" in reason and sec.tls_ca):
                    return _client_cert_required(address, tls_flags)
                if "ALERT" in reason and not sec.tls_ca:
                    return _tls_required(address)
                if sec.tls_ca:
                    return _tls_unsupported(address)
                return Diagnosis("ok", f"the server at {address} answers in plaintext, as this client speaks")
            except OSError:  # reset or closed during the handshake: not a TLS server
                if sec.tls_ca:
                    return _tls_unsupported(address)
                return Diagnosis("ok", f"the server at {address} answers in plaintext, as this client speaks")
            sock = tls
            if not sec.tls_ca:
                return _tls_required(address)
            # TLS 1.3: a server that requires a client certificate says so after the handshake
            # (an alert, or it just closes); a server that accepted us waits for our HTTP/2 preface
            tls.settimeout(min(timeout, 0.5))
            try:
                closed = tls.recv(1) == b""
            except ssl.SSLError as e:
                closed = "CERTIFICATE_REQUIRED" in (e.reason or "") or "ALERT" in (e.reason or "")
            except (ConnectionError, socket.timeout):
                closed = False
            if closed:
                if sec.tls_cert:
                    return Diagnosis(
                        "client_cert_required",
                        f"the server at {address} refused this client's certificate after the TLS handshake: "
                        "is it signed by the CA the server trusts (its --tls-ca)?",
                    )
                return _client_cert_required(address, tls_flags)
            return Diagnosis("ok", f"the server at {address} speaks TLS with a certificate the CA given accepts")
    except (ssl.SSLError, OSError, ValueError) as e:  # e.g. an unreadable CA file
        return Diagnosis("unknown", f"could not probe {address}: {e}")
    finally:
        sock.close()


def _tls_required(address: str) -> Diagnosis:
    return Diagnosis(
        "tls_required",
        f"the server at {address} speaks TLS but this client connects in plaintext: "
        "give the CA that signed its certificate (--tls-ca CA.crt; formerly --root-cert)",
    )


def _tls_unsupported(address: str) -> Diagnosis:
    return Diagnosis(
        "tls_unsupported",
        f"the server at {address} does not speak TLS (plaintext) but this client uses TLS (--tls-ca): "
        "drop --tls-ca, or start the server with --tls-cert/--tls-key",
    )


def _client_cert_required(address: str, flags: str) -> Diagnosis:
    return Diagnosis(
        "client_cert_required",
        f"the server at {address} requires a client certificate (mutual TLS): give this client's {flags} "
        "(tessera cert --clients NAME makes one)",
    )
