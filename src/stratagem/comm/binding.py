"""Which address a server of ours listens on: its task's own, never every interface unasked.

The rendezvous store and the liveness servers bind the address their task is known by in the
cluster (a loopback job: 127.0.0.1 only). Listening on every interface (``0.0.0.0``/``::``) is
for machines whose task address is not one of their own (behind NAT, or a name that resolves
elsewhere) and must be asked for: ``STRATAGEM_BIND_ALL=1``.
"""

from __future__ import annotations

import os
import socket
import struct

from stratagem.cluster.address import is_loopback

BIND_ALL_VARIABLE = "STRATAGEM_BIND_ALL"


def bind_all_requested() -> bool:
    """Whether the user asked every server to listen on all interfaces."""
    raw = os.environ.get(BIND_ALL_VARIABLE, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ValueError(f"{BIND_ALL_VARIABLE}={raw!r}: expected 1 (listen on all interfaces) or 0")


def bind_address(host: str, port: int) -> tuple[socket.AddressFamily, str]:
    """The family and address a server for ``host`` binds (``port`` only helps resolution).

    Raises ``OSError`` (from name resolution) when ``host`` does not resolve."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if is_loopback(host):
        return (socket.AF_INET6, "::1") if host == "::1" else (socket.AF_INET, "127.0.0.1")
    if bind_all_requested():
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return family, "::" if family == socket.AF_INET6 else "0.0.0.0"
    # The first address the name resolves to, as a client connecting to it would try first.
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    return socket.AddressFamily(family), str(sockaddr[0])


def bind_hint(host: str, address: str) -> str:
    """What to tell a user whose server could not bind ``address`` for ``host``."""
    if is_loopback(host) or bind_all_requested():
        return ""
    return (
        f"; {host!r} resolves to {address}, which must be an address of this machine "
        f"(or set {BIND_ALL_VARIABLE}=1 to listen on all interfaces)"
    )


# The transports torch starts after the rendezvous choose their own listening address: gloo and
# TensorPipe take the interface these variables name, else whatever this machine's host name
# resolves to (a routable address even in a loopback job). Naming the task's interface keeps
# them on the task's own address too.
TRANSPORT_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of the network interface holding IPv4 ``address`` (Linux), else None."""
    try:
        import fcntl  # Unix only: elsewhere torch keeps choosing by itself

        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(
                        s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
                    )
                except OSError:
                    continue  # an interface without an IPv4 address
                if socket.inet_ntoa(packed[20:24]) == address:
                    return name
    except (ImportError, OSError):
        return None
    return None


def pin_transport_interfaces(host: str) -> None:
    """Make gloo and TensorPipe listen on the interface of ``host``'s own address.

    A variable the user set is kept, and nothing is pinned when every interface was asked for
    or the interface is not found (then torch chooses as before)."""
    if bind_all_requested() or all(os.environ.get(v) for v in TRANSPORT_INTERFACE_VARIABLES):
        return
    try:
        family, address = bind_address(host, 0)
    except OSError:
        return
    name = interface_of(address) if family == socket.AF_INET else None
    if name is None:
        return
    for variable in TRANSPORT_INTERFACE_VARIABLES:
        if not os.environ.get(variable):
            os.environ[variable] = name
