"""``host:port`` addresses of cluster tasks: parsing with clear errors, and formatting.

Processes of a job connect to these addresses (rank 0's address is where the rendezvous store
listens), so a typo here would otherwise surface much later as a hang or a DNS failure. The
parser is strict on purpose and says what it expected.
"""

from __future__ import annotations

import ipaddress
import re

from stratagem.errors import ClusterConfigError

#: The only scheme TensorFlow accepts in front of a cluster address; it is stripped.
GRPC_PREFIX = "grpc://"

# Hostnames and IPv4 literals: letters, digits, '.', '-', '_' (docker-style names use '_').
_HOST_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")
_PORT_RE = re.compile(r"[0-9]+")
_EXPECTED = "expected 'host:port' such as 'localhost:12345' or '[::1]:12345'"


def _bad(text: object, why: str) -> ClusterConfigError:
    return ClusterConfigError(f"invalid address {text!r}: {why}; {_EXPECTED}")


def check_port(port: object, what: str = "port") -> int:
    """Return ``port`` as an int after checking it is a TCP port (1..65535).

    ``what`` names the value in the error ("MASTER_PORT", say). Strings of digits are accepted
    because ports usually arrive through environment variables.
    """
    if isinstance(port, bool):  # bool is an int subclass; True is not port 1
        raise ClusterConfigError(f"{what} must be an integer in 1..65535, got {port!r}")
    if isinstance(port, str):
        if not _PORT_RE.fullmatch(port):
            raise ClusterConfigError(
                f"{what} must be an integer in 1..65535, got {port!r} (not a decimal number)"
            )
        port = int(port)
    if not isinstance(port, int):
        raise ClusterConfigError(
            f"{what} must be an integer in 1..65535, got {type(port).__name__} {port!r}"
        )
    if not 1 <= port <= 65535:
        raise ClusterConfigError(f"{what} must be in 1..65535, got {port}")
    return port


def parse_address(text: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[ipv6]:port``) into ``(host, port)``.

    A leading ``grpc://`` is stripped because TensorFlow accepts it in TF_CONFIG addresses and
    ``master()`` strings; any other scheme is rejected. IPv6 hosts must be bracketed
    (``[::1]:2222``) and come back without brackets (``("::1", 2222)``). Rejected, each with an
    error echoing the text: non-strings, whitespace anywhere, an empty host, a missing,
    non-numeric or out-of-range port (valid ports are 1..65535).
    """
    if not isinstance(text, str):
        raise _bad(text, f"an address must be a string, got {type(text).__name__}")
    if not text:
        raise _bad(text, "it is empty")
    if any(ch.isspace() for ch in text):
        raise _bad(text, "it contains whitespace")
    rest = text[len(GRPC_PREFIX) :] if text.startswith(GRPC_PREFIX) else text
    if "://" in rest:
        scheme = rest.split("://", 1)[0]
        raise _bad(
            text, f"scheme '{scheme}://' is not supported (only a leading 'grpc://' is accepted)"
        )
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise _bad(text, "'[' opens an IPv6 host but no ']' closes it")
        host, after = rest[1:close], rest[close + 1 :]
        if not host:
            raise _bad(text, "the host between '[' and ']' is empty")
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise _bad(text, f"{host!r} between brackets is not an IPv6 address") from None
        if not after.startswith(":"):
            raise _bad(text, "the port is missing after ']'")
        port_text = after[1:]
    else:
        if ":" not in rest:
            raise _bad(text, "the port is missing")
        if rest.count(":") > 1:
            raise _bad(text, "it has several ':'; an IPv6 host must be bracketed as [::1]:port")
        host, _, port_text = rest.partition(":")
        if not host:
            raise _bad(text, "the host is empty")
        if not _HOST_RE.fullmatch(host):
            raise _bad(text, f"host {host!r} may only contain letters, digits, '.', '-' and '_'")
    if not port_text:
        raise _bad(text, "the port is missing")
    if not _PORT_RE.fullmatch(port_text):
        raise _bad(text, f"port {port_text!r} is not a decimal number")
    port = int(port_text)
    if not 1 <= port <= 65535:
        raise _bad(text, f"port {port} is outside 1..65535")
    return host, port


def format_address(host: str, port: int) -> str:
    """Join ``host`` and ``port`` as ``host:port``, bracketing IPv6 hosts (``[::1]:2222``)."""
    if not isinstance(host, str) or not host:
        raise ClusterConfigError(f"host must be a non-empty string, got {host!r}")
    port = check_port(port)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine's loopback (``localhost``, ``127.x``, ``::1``)."""
    return host in ("localhost", "127.0.0.1", "::1") or host.startswith("127.")
