"""Requests and replies between the tasks of a job, over TCP, carrying plain data only.

A task serves a fixed table of methods through a ``MessageServer`` (a ps's ``methods``, a
coordinator's worker); a client keeps one ``Connection`` to each server. Nothing a peer sends is
unpickled or imported: a message is one ``plain_data`` frame, and a request can only name a
method of the table. Opening: the server sends ``b"SGM1"``, whether the job has a secret, and a
32-byte challenge; the client, its task name and ``job_secret.proof(secret, challenge, name)``;
the server accepts (``b"\\x01"``) or sends why not (``b"\\x00"``, length, text) and hangs up.
Then ``{"id", "method", "args"}`` requests, one at a time, get ``{"id", "result"}`` or
``{"id", "error": [type, message]}``; while a reply waits on other tasks the server says so
(``"waiting"``), and the client ends that wait with a ``CollectiveTimeoutError`` naming them only
once they stop answering their liveness probe. A frame outside the schema or an unknown method
is a ``PeerDataError`` that closes that connection alone. Tensors travel as their own memory
(``shared_segment.py`` between processes of one machine).
"""

from __future__ import annotations

import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.futures import Future

from stratagem.cluster.address import parse_address
from stratagem.cluster.job_secret import proof, proof_ok
from stratagem.comm import plain_data, shared_segment
from stratagem.comm.binding import bind_address, bind_hint
from stratagem.errors import (
    CollectiveTimeoutError,
    PeerDataError,
    PeerLostError,
    RendezvousError,
)

_HELLO = b"SGM1"
_CHALLENGE_BYTES = 32
_PROOF_BYTES = 32
_MAX_NAME_BYTES = 256
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_BUFFER_BYTES = 64 << 10

# Errors a server's method may raise that the caller gets back as the same type (any other is a
# RuntimeError); their messages say what went wrong on the server.
_ERROR_TYPES: dict[str, type[Exception]] = {
    t.__name__: t
    for t in (
        KeyError,
        ValueError,
        TypeError,
        RuntimeError,
        ImportError,
        AttributeError,
        PeerDataError,
        CollectiveTimeoutError,
    )
}


class ConnectionClosed(ConnectionError):
    """The peer hung up (its process may have ended)."""


@dataclass
class Later:
    """A reply that comes later: ``value(result)`` once ``future`` is done. Meanwhile
    ``waiting()`` says what the reply waits for: why, and the names of the tasks it waits on."""

    future: Future
    waiting: Callable[[], tuple[str, list[str]]]
    value: Callable[[Any], Any] = field(default=lambda result: result)


@dataclass(frozen=True)
class Here:
    """A reply worked out on the connection's own thread: ``work()``'s result. While it runs,
    the server's note thread sends the client ``waiting()`` notes, as for a ``Later`` (a long
    call is not a silence). For a call the client waits on anyway (a coordinator's scheduled
    function): no second thread on the call's path, no hand-over to it and back (two
    wake-ups per call, each a trip through a busy machine's scheduler)."""

    work: Callable[[], Any]
    waiting: Callable[[], tuple[str, list[str]]]


class _Working:
    """A ``Here`` call in progress: its channel and request, and whether notes may still go
    (cleared, under the channel's send lock, before its reply)."""

    def __init__(self, channel: _Channel, rid: int, waiting: Callable[[], tuple[str, list[str]]]):
        self.channel = channel
        self.rid = rid
        self.waiting = waiting
        self.active = True


# ---------------------------------------------------------------------------------- the wire


def _reader(sock: socket.socket) -> Callable[[memoryview], None]:
    def read_into(buffer: memoryview) -> None:
        got, size = 0, len(buffer)
        while got < size:
            n = sock.recv_into(buffer[got:], size - got, socket.MSG_WAITALL)
            if n == 0:
                raise ConnectionClosed("the connection was closed")
            got += n

    return read_into


def _read_exact(sock: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    _reader(sock)(memoryview(buffer))
    return bytes(buffer)


def _send_all(sock: socket.socket, buffers: list[Any]) -> None:
    """Write every buffer, in order, without joining them into one copy."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent:
            if sent >= len(views[0]):
                sent -= len(views.pop(0))
            else:
                views[0] = views[0][sent:]
                sent = 0


class _Channel:
    """One side of a connection after its opening: frames out and in, each after a kind byte
    (0: its tensors follow on the socket; 1: they are in the sender's shared-memory segment;
    2: a new, larger segment is announced first, then as 1)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.sending: shared_segment.SendSegment | None = None
        self.receiving: shared_segment.ReceiveSegment | None = None
        self.borrowed = False  # the last frame's tensors are views of the peer's segment
        self.tensors: list[torch.Tensor] = []  # the last frame's tensors, in order
        self._read_direct = _reader(sock)
        # Held for each frame sent: a server's note thread and the thread answering a request
        # both send on it (``Here``); re-entrant, so a note can be sent while it is held.
        self.send_lock = threading.RLock()
        # What arrived beyond the last read: one recv brings a frame's kind, preamble and
        # header at once (each recv that must wait is a trip through the scheduler).
        self._buffer = bytearray(_BUFFER_BYTES)
        self._start = self._end = 0

    def _read_into(self, out: memoryview) -> None:
        """Fill ``out`` from the buffered bytes, then the socket (large reads go straight into
        ``out``; only frames are read this way, after the opening)."""
        have = self._end - self._start
        if have:
            k = min(have, len(out))
            out[:k] = self._buffer[self._start : self._start + k]
            self._start += k
            if k == len(out):
                return
            out = out[k:]
        if len(out) >= _BUFFER_BYTES // 2:
            self._read_direct(out)
            return
        view = memoryview(self._buffer)
        self._start = self._end = 0
        while self._end < len(out):
            n = self.sock.recv_into(view[self._end :])
            if n == 0:
                raise ConnectionClosed("the connection was closed")
            self._end += n
        out[:] = view[: len(out)]
        self._start = len(out)

    def offer_segment(self) -> None:
        """Offer a segment for what this side sends; the other side confirms it could open it."""
        if not shared_segment.available():
            self.sock.sendall(b"\x00")
            return
        segment = shared_segment.SendSegment(1 << 20)
        try:
            self.sock.sendall(b"\x01" + segment.announce)
            confirmed = _read_exact(self.sock, 1) == b"\x01"
        except BaseException:
            segment.close()
            raise
        if confirmed:
            self.sending = segment
        else:
            segment.close()

    def accept_segment(self, peer: str) -> bool:
        """Read the other side's offer; open its segment if there is one (True if so)."""
        if _read_exact(self.sock, 1) != b"\x01":
            return False
        try:
            self.receiving = shared_segment.ReceiveSegment(
                lambda n: _read_exact(self.sock, n), peer=peer, check=True
            )
        except PeerDataError:
            self.sock.sendall(b"\x00")  # another machine, or another /dev/shm: the socket
            return False
        self.sock.sendall(b"\x01")
        return True

    def send(self, value: Any, *, what: str) -> None:
        head, tensors = plain_data.encode_parts(value, what=what)
        buffers = [plain_data.tensor_buffer(t) for t in tensors if t.numel()]
        with self.send_lock:
            if self.sending is not None and shared_segment.tensor_bytes(tensors) >= (
                shared_segment.MIN_BYTES
            ):
                announce = self.sending.write(buffers)
                prefix = b"\x01" if announce is None else b"\x02" + announce
                _send_all(self.sock, [prefix, head])
            else:
                _send_all(self.sock, [b"\x00", head, *buffers])

    def receive(
        self, *, sender: str, what: str, into: Sequence[torch.Tensor] = (), borrow: bool = False
    ) -> Any:
        """The next frame's value; ``into`` offers its tensors a home (``read_frame``). With
        ``borrow``, tensors that came through shared memory are views of it, valid until the
        peer sends again (a server's request, once it has answered)."""
        first = bytearray(1)
        self._read_into(memoryview(first))
        kind = bytes(first)
        self.borrowed = borrow and kind != b"\x00"
        self.tensors = []
        if kind == b"\x00":
            return plain_data.read_frame(
                self._read_into, sender=sender, what=what, into=into, kept=self.tensors
            )
        if kind == b"\x02":
            if self.receiving is None:
                raise PeerDataError(f"{sender} announced a shared-memory segment unasked")
            self.receiving.close()
            self.receiving = None
            self.receiving = shared_segment.ReceiveSegment(
                self._read_bytes, peer=sender, check=False
            )
        elif kind != b"\x01" or self.receiving is None:
            raise PeerDataError(
                f"{sender} sent a frame of kind {kind!r} during {what}; expected 0 (tensors on "
                "the socket)" + (" or 1 or 2 (in shared memory)" if self.receiving else "")
            )
        return plain_data.read_frame(
            self._read_into,
            sender=sender,
            what=what,
            read_tensors_into=None if borrow else self.receiving.reader(),
            into=into,
            lend=self.receiving.lender() if borrow else None,
            kept=self.tensors,
        )

    def _read_bytes(self, size: int) -> bytes:
        out = bytearray(size)
        self._read_into(memoryview(out))
        return bytes(out)

    def close(self) -> None:
        for segment in (self.sending, self.receiving):
            if segment is not None:
                segment.close()
        self.sending = self.receiving = None


def _same_machine(sock: socket.socket) -> bool:
    """Whether the two ends of a connection have the same address (then they may share
    memory: the opening checks that they do)."""
    try:
        return sock.getpeername()[0] == sock.getsockname()[0]
    except OSError:
        return False


# ---------------------------------------------------------------------------------- server


class MessageServer:
    """Serves ``methods`` to the job's tasks named in ``clients``, on ``host:port`` (a thread per
    connection). ``name`` describes this server in what it prints and sends."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        name: str,
        secret: bytes | None,
        clients: Collection[str],
        methods: Mapping[str, Callable[..., Any]],
        handshake_timeout: float,
        note_every: float,
    ) -> None:
        try:
            family, bind = bind_address(host, port)
        except OSError as e:
            raise RendezvousError(
                f"{name} cannot listen on {host}:{port}: {host!r} does not resolve ({e})"
            ) from None
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        # A restarted task takes its address back while the old connections linger in TIME_WAIT.
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((bind, port))
        except OSError as e:
            self._sock.close()
            raise RendezvousError(
                f"{name} cannot listen on its address {host}:{port} ({bind}): "
                f"{e.strerror or e}{bind_hint(host, bind)}"
            ) from None
        self._sock.listen(64)
        self.name = name
        self._secret = secret
        self._clients = frozenset(clients)
        self._methods = dict(methods)
        self._handshake_timeout = handshake_timeout
        self._note_every = note_every
        self._lock = threading.Lock()
        self._open: dict[socket.socket, str] = {}  # connection -> the task on it
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._working: set[_Working] = set()  # the ``Here`` calls in progress
        self._notes: threading.Thread | None = None  # sends their notes (made at the first)
        self._stop_notes = threading.Event()
        self.refused = 0  # connections and requests refused (for tests)
        self._thread = threading.Thread(target=self._accept, name=f"{name} server", daemon=True)
        self._thread.start()

    def open_connections(self) -> list[str]:
        """The tasks with a connection open now."""
        with self._lock:
            return sorted(self._open.values())

    def close(self, wait_s: float = 5.0) -> None:
        """Stop listening, hang up every connection, and wait (up to ``wait_s``) for their
        threads to end: a thread still inside torch when the interpreter exits aborts the
        process ("terminate called without an active exception")."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._stop_notes.set()
        with self._lock:
            self._closed = True
            threads = list(self._threads)
            if self._notes is not None:
                threads.append(self._notes)
            for conn in list(self._open):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        deadline = time.monotonic() + wait_s
        for thread in [self._thread, *threads]:
            if thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _accept(self) -> None:
        while True:
            try:
                conn, address = self._sock.accept()
            except OSError:
                return  # closed
            thread = threading.Thread(
                target=self._serve, args=(conn, f"{address[0]}:{address[1]}"), daemon=True
            )
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
            thread.start()

    def _refuse(self, who: str, why: str) -> None:
        with self._lock:
            self.refused += 1
        print(f"[{self.name}] refused {who}: {why}", file=sys.stderr, flush=True)

    def _handshake(self, conn: socket.socket, peer: str) -> str | None:
        """The task name the client proved, or None (refused and told why)."""
        challenge = secrets.token_bytes(_CHALLENGE_BYTES)
        conn.sendall(_HELLO + (b"\x01" if self._secret else b"\x00") + challenge)
        size = int.from_bytes(_read_exact(conn, 2), "little")
        why = None
        if not 0 < size <= _MAX_NAME_BYTES:
            who = f"a connection from {peer}"
            why = f"it announced a task name of {size} bytes (1 to {_MAX_NAME_BYTES})"
        else:
            raw = _read_exact(conn, size)
            name = raw.decode("utf-8", errors="replace")
            who = f"a connection from {peer} claiming to be {name!r}"
            answer = _read_exact(conn, _PROOF_BYTES) if self._secret else b""
            if self._secret and not proof_ok(self._secret, challenge, name, answer):
                why = (
                    "its proof of the job secret is wrong (a process that is not part of this "
                    "job, or one given another STRATAGEM_JOB_SECRET)"
                )
            elif name not in self._clients:
                why = f"{name!r} is not a task this server serves ({sorted(self._clients)})"
        if why is not None:
            self._refuse(who, f"PeerDataError: {why}")
            reason = f"{self.name} refused the connection: {why}".encode()[:4096]
            try:
                conn.sendall(b"\x00" + len(reason).to_bytes(2, "little") + reason)
            except OSError:
                pass
            return None
        return name

    def _serve(self, conn: socket.socket, peer: str) -> None:
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self._handshake_timeout)
            try:
                who = self._handshake(conn, peer)
            except (OSError, UnicodeError) as e:
                self._refuse(f"a connection from {peer}", f"its opening failed ({e})")
                return
            if who is None:
                return
            with self._lock:  # before it is accepted: a close from now on hangs it up
                if self._closed:
                    return
                self._open[conn] = who
            channel = _Channel(conn)
            try:
                conn.sendall(b"\x01")
                # Shared memory for the tensors, both ways, when the client offers it.
                if channel.accept_segment(f"{who} ({peer})"):
                    channel.offer_segment()
                conn.settimeout(None)  # a worker may be quiet between steps as long as it likes
                self._requests(channel, f"{who} ({peer})")
            except (OSError, ConnectionError):
                pass  # it hung up
            except PeerDataError as e:
                self._refuse(f"a connection from {who} ({peer})", f"PeerDataError: {e}")
            finally:
                channel.close()
                with self._lock:
                    self._open.pop(conn, None)

    def _requests(self, channel: _Channel, sender: str) -> None:
        what = f"a request to {self.name}"
        # A request's tensors are lent to the method: views of the client's shared-memory
        # segment, which it writes again only once it has the reply; or, on the socket, the
        # tensors the next request is read into (memory already mapped, without a fresh
        # allocation's page faults). A method that keeps a tensor it was sent must copy it.
        lent: list[torch.Tensor] = []
        while True:
            try:
                request = None  # no view of the segment outlives its request
                request = channel.receive(sender=sender, what=what, into=lent, borrow=True)
                rid, method = _check_request(request, self._methods, sender=sender, what=what)
            except (OSError, ConnectionError):
                return  # the client hung up (or its process ended)
            except PeerDataError as e:
                self._refuse(f"a request from {sender}", f"PeerDataError: {e}")
                try:
                    channel.send({"id": -1, "error": ["PeerDataError", str(e)]}, what=what)
                except OSError:
                    pass
                return
            try:
                reply = {"id": rid, "result": self._call(channel, rid, method, request["args"])}
                channel.send(reply, what=f"the reply of {self.name}")
                lent = [] if channel.borrowed else channel.tensors
            except OSError:
                return
            except Exception as e:
                error = {"id": rid, "error": [type(e).__name__, str(e)]}
                try:
                    channel.send(error, what=f"the reply of {self.name}")
                except OSError:
                    return

    def _call(self, channel: _Channel, rid: int, method: Callable[..., Any], args: list) -> Any:
        result = method(*args)
        if isinstance(result, Here):
            return self._here(channel, rid, result)
        if not isinstance(result, Later):
            return result
        done = threading.Event()
        result.future.add_done_callback(lambda _: done.set())
        while not done.wait(self._note_every):
            if self._closed:
                raise ConnectionClosed(f"{self.name} closed")
            why, tasks = result.waiting()
            channel.send({"id": rid, "waiting": [why, tasks]}, what="a note")
        return result.value(result.future.wait())

    def _here(self, channel: _Channel, rid: int, here: Here) -> Any:
        """Run ``here.work()`` on this thread; the note thread says meanwhile that it runs."""
        working = _Working(channel, rid, here.waiting)
        with self._lock:
            if self._closed:
                raise ConnectionClosed(f"{self.name} closed")
            self._working.add(working)
            if self._notes is None:
                self._notes = threading.Thread(
                    target=self._send_notes, name=f"{self.name} notes", daemon=True
                )
                self._notes.start()
        try:
            return here.work()
        finally:
            with self._lock:
                self._working.discard(working)
            # A note the note thread is sending goes out before the reply; none after it
            # (the client would take a note of this request for one of its next).
            with channel.send_lock:
                working.active = False

    def _send_notes(self) -> None:
        """Every ``note_every`` seconds, a note for each ``Here`` call still running."""
        while not self._stop_notes.wait(self._note_every):
            with self._lock:
                working = list(self._working)
            for w in working:
                with w.channel.send_lock:
                    if not w.active:
                        continue
                    try:
                        why, tasks = w.waiting()
                        w.channel.send({"id": w.rid, "waiting": [why, tasks]}, what="a note")
                    except (OSError, ConnectionError):
                        pass  # hung up: the reply's send finds it too


def _check_request(
    request: Any, methods: Mapping[str, Any], *, sender: str, what: str
) -> tuple[int, Callable[..., Any]]:
    if (
        not isinstance(request, dict)
        or set(request) != {"id", "method", "args"}
        or type(request["id"]) is not int
        or not isinstance(request["method"], str)
        or not isinstance(request["args"], list)
    ):
        raise PeerDataError(
            f"{sender} sent {what} that is not {{'id': int, 'method': str, 'args': list}}: "
            f"{_shorten(request)}"
        )
    method = methods.get(request["method"])
    if method is None:
        raise PeerDataError(
            f"{sender} asked for the method {_shorten(request['method'])}, which is not one "
            f"this server has ({', '.join(sorted(methods))})"
        )
    return request["id"], method


def _shorten(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


# ---------------------------------------------------------------------------------- client


class Connection:
    """This task's connection to one server: ``call`` a method, or ``send`` then ``receive``
    to have several servers work at once. ``peer`` describes the server in errors."""

    def __init__(
        self, address: str, *, me: str, peer: str, secret: bytes | None, timeout: float
    ) -> None:
        self.peer = peer
        self._timeout = timeout
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise PeerLostError(f"{me} cannot connect to {peer}: {e.strerror or e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            hello = _read_exact(sock, len(_HELLO) + 1 + _CHALLENGE_BYTES)
            if hello[: len(_HELLO)] != _HELLO:
                raise PeerDataError(f"{peer} opened with {hello[:8]!r}, not a stratagem hello")
            challenged = hello[len(_HELLO)] == 1
            name = me.encode()
            answer = len(name).to_bytes(2, "little") + name
            if challenged:
                if secret is None:
                    raise RendezvousError(
                        f"{peer} asks for a proof of the job secret, and {me} runs without one "
                        "(STRATAGEM_INSECURE=1): every task of a job must use the same secret"
                    )
                answer += proof(secret, hello[len(_HELLO) + 1 :], me)
            sock.sendall(answer)
            if _read_exact(sock, 1) != b"\x01":
                size = int.from_bytes(_read_exact(sock, 2), "little")
                why = _read_exact(sock, size).decode(errors="replace")
                raise RendezvousError(f"{me} was refused by {peer}: {why}")
            channel = _Channel(sock)
            if _same_machine(sock):
                channel.offer_segment()
                if channel.sending is not None:
                    channel.accept_segment(peer)
            else:
                sock.sendall(b"\x00")
        except (OSError, ConnectionError) as e:
            sock.close()
            raise PeerLostError(
                f"{me} lost its connection to {peer} while opening it: {e}"
            ) from None
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._channel = channel
        self._next = 0
        self.lock = threading.Lock()  # one request at a time; callers hold it send to receive

    @property
    def closed(self) -> bool:
        """Whether this connection was closed (by ``close``, or after a lost or silent peer)."""
        return self._sock.fileno() < 0

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._channel.close()

    def call(self, method: str, args: list, *, what: str, **kwargs: Any) -> Any:
        with self.lock:
            return self.receive(self.send(method, args, what=what), what=what, **kwargs)

    def send(self, method: str, args: list, *, what: str) -> int:
        self._next += 1
        request = {"id": self._next, "method": method, "args": args}
        try:
            self._sock.settimeout(self._timeout)
            self._channel.send(request, what=what)
        except OSError as e:
            raise self._lost(what, e) from None
        return self._next

    def receive(
        self,
        rid: int,
        *,
        what: str,
        silent: Callable[[list[str]], list[str]],
        peer_ended: Callable[[], bool],
        into: Sequence[torch.Tensor] = (),
    ) -> Any:
        """The reply to request ``rid``. ``silent(tasks)`` says which of the tasks a waiting
        server named do not answer their liveness probe; ``peer_ended()`` whether the server's
        own process has ended. ``into`` offers the reply's tensors a home, by position (the
        caller's own tensors: they are written as the reply arrives)."""
        start = time.monotonic()
        deadline = start + self._timeout
        stuck: tuple[str, list[str]] | None = None
        while True:
            self._sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                message = self._channel.receive(sender=self.peer, what=what, into=into)
            except TimeoutError:
                raise self._timed_out(what, time.monotonic() - start, stuck, peer_ended) from None
            except (OSError, ConnectionError) as e:
                raise self._lost(what, e) from None
            if not isinstance(message, dict) or message.get("id") not in (rid, -1):
                raise PeerDataError(f"{self.peer} answered {what} with {_shorten(message)}")
            if "waiting" in message:
                why, tasks = message["waiting"]
                gone_quiet = silent(list(tasks))
                if gone_quiet:
                    stuck = (str(why), gone_quiet)
                else:  # a legitimate wait, on tasks that are alive and working
                    stuck = None
                    deadline = time.monotonic() + self._timeout
                if time.monotonic() >= deadline:  # notes keep coming: the clock decides
                    raise self._timed_out(what, time.monotonic() - start, stuck, peer_ended)
                continue
            if "error" in message:
                kind, text = message["error"]
                error = _ERROR_TYPES.get(kind, RuntimeError)
                raise error(f"{self.peer} could not do {what}: {text}")
            return message["result"]

    def _lost(self, what: str, e: BaseException) -> PeerLostError:
        self.close()
        return PeerLostError(
            f"{self.peer} did not answer {what}: the connection closed ({e}); its process ended"
        )

    def _timed_out(
        self,
        what: str,
        waited: float,
        stuck: tuple[str, list[str]] | None,
        peer_ended: Callable[[], bool],
    ) -> Exception:
        self.close()
        if peer_ended():
            return PeerLostError(f"{self.peer} did not answer {what}: its process ended")
        if stuck is not None:
            why, tasks = stuck
            return CollectiveTimeoutError(
                f"{what} to {self.peer} did not complete in {waited:.0f} s: {why}, and "
                f"{' and '.join(tasks)} has not answered its liveness probe for "
                f"{self._timeout:.0f} s (stopped or stuck; STRATAGEM_OP_TIMEOUT sets the wait)"
            )
        return CollectiveTimeoutError(
            f"{self.peer} did not answer {what} in {waited:.0f} s: its process is alive but "
            "does not answer (stopped or stuck; STRATAGEM_OP_TIMEOUT sets the wait)"
        )
