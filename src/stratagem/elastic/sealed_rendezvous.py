"""torch's dynamic rendezvous over the job's store, sealed with the job's secret.

``sealed_handler`` hosts (or joins) a ``TCPStore`` on the rendezvous address, seals it with the
job's secret (``comm.sealed_store``) and runs torch's own ``C10dRendezvousBackend`` and
``DynamicRendezvousHandler`` over it, unchanged: every join, leave and heartbeat rewrites the
sealed state, so only a holder of the secret takes part, and a record written without it is
our ``RendezvousError`` before torch unpickles anything. A node given another secret is refused
at once by name. Its ``next_rendezvous`` points workers at that same store
(``bootstrap_store_info``, ``use_agent_store``); torch's second, unsealed store server stays off
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). ``create_handler`` is torch's backend ``"stratagem"``
(``elastic.torchrun_backend`` registers it); ``explain`` finds our error inside torch's
``RendezvousConnectionError``.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousTimeout,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

from stratagem.cluster.address import format_address
from stratagem.cluster.job_secret import job_secret as find_job_secret
from stratagem.cluster.job_secret import key_for
from stratagem.comm.binding import bind_all_requested
from stratagem.comm.rendezvous import listen_socket, wait_for_port
from stratagem.comm.sealed_store import sealed
from stratagem.elastic.torch_state import joined_round
from stratagem.errors import ClusterConfigError, RendezvousError

BACKEND = "stratagem"
# torch's c10d backend's port for an endpoint that names none.
DEFAULT_PORT = 29400
# Read by torch's handler at each round: unset, the round's rank 0 opens a second store server
# of its own, unsealed and open to anyone, and points workers there.
SHARE_STORE_VARIABLE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# A record under a fixed, unsealed name: what the host's secret proves, so that a node given
# another secret is told so at once instead of waiting alone under key names nobody else uses.
_SECRET_CHECK_KEY = "stratagem/rendezvous-secret-check"
_INSECURE_CHECK = b"insecure"
# torchrun's --rdzv-id when none is given.
_UNSET_RUN_IDS = ("", "none")
# How an operation's failure is marked on torch's exception (``explain`` reads it back).
_NOTE = "stratagem rendezvous: "

_T = TypeVar("_T")


def run_id_for(secret: bytes | None) -> str:
    """The run id of a job that names none: derived from its secret (16 hex digits)."""
    if secret is None:
        return "stratagem-insecure"
    return hmac.new(secret, b"rdzv-run-id", hashlib.sha256).hexdigest()[:16]


def _secret_check(secret: bytes | None) -> bytes:
    return _INSECURE_CHECK if secret is None else key_for(secret, "rendezvous-check").hex().encode()


class SealedRendezvous(RendezvousHandler):
    """torch's ``DynamicRendezvousHandler`` over the sealed store, seen by its agent.

    Only torch's abstract interface is derived from; every call goes to torch's handler as it
    is. What differs: the backend's name, the rounds' store address (the store's own), the
    round joined (``round``), and a note on each failure naming this node and the operation.
    """

    def __init__(
        self,
        torch_handler: DynamicRendezvousHandler,
        *,
        base_store: dist.Store,
        store: dist.Store | None = None,
        host: str,
        port: int,
        where: str,
    ) -> None:
        self._torch = torch_handler
        # Held for the handler's life: the host's store server lives as long as this object.
        self._base_store = base_store
        self._store = store  # the sealed store torch's handler runs over
        self._store_info = RendezvousStoreInfo(master_addr=host, master_port=port)
        self._address = format_address(host, port)
        self._where = where
        self._round: int | None = None

    @property
    def round(self) -> int:
        """The round the last ``next_rendezvous`` joined."""
        if self._round is None:
            raise RendezvousError(f"{self._where} has joined no round of the rendezvous yet")
        return self._round

    @property
    def store(self) -> dist.Store:
        """The job's store, sealed, as the workers see it (the agent tells them its decisions
        there)."""
        assert self._store is not None
        return self._store

    @property
    def store_address(self) -> tuple[str, int]:
        """Where the rendezvous store listens (workers open their own sealed client there)."""
        return self._store_info.master_addr, self._store_info.master_port

    @property
    def use_agent_store(self) -> bool:
        # Workers reach the agents' store (``TORCHELASTIC_USE_AGENT_STORE=True``) and seal their
        # own client with the job's secret; torch's own answer follows the variable set below.
        return True

    def get_backend(self) -> str:
        return BACKEND

    def get_run_id(self) -> str:
        return self._torch.get_run_id()

    def next_rendezvous(self) -> RendezvousInfo:
        os.environ[SHARE_STORE_VARIABLE] = "1"  # read by torch at each round, so set each time
        info = self._noted("join the next round", self._torch.next_rendezvous)
        self._round = joined_round(self._torch)
        return RendezvousInfo(info.store, info.rank, info.world_size, self._store_info)

    def is_closed(self) -> bool:
        return self._noted("read whether the rendezvous is closed", self._torch.is_closed)

    def set_closed(self) -> None:
        self._noted("close the rendezvous", self._torch.set_closed)

    def num_nodes_waiting(self) -> int:
        return self._noted("count the nodes waiting", self._torch.num_nodes_waiting)

    def shutdown(self) -> bool:
        return self._noted("shut the rendezvous down", self._torch.shutdown)

    def _noted(self, operation: str, call: Callable[[], _T]) -> _T:
        try:
            return call()
        except Exception as e:
            e.add_note(f"{_NOTE}{self._where} could not {operation} at {self._address}")
            raise


def explain(error: BaseException) -> str:
    """One line for the user: this job's own error (a forged or unreadable record, a secret
    mismatch) found in the chain of torch's exception, with the node and the operation the
    handler noted on it; else torch's own error, named by type."""
    context = next(
        (n[len(_NOTE) :] for n in getattr(error, "__notes__", ()) if n.startswith(_NOTE)), None
    )
    ours = _ours(error)
    if ours is not None:
        what = str(ours)
    else:
        what = f"{type(error).__name__}: {error}" if str(error) else type(error).__name__
    return f"{context}: {what}" if context else what


def _ours(error: BaseException) -> RendezvousError | None:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, RendezvousError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _open_store(
    host: str, port: int, *, is_host: bool, secret: bytes | None, timeout_s: float, where: str
) -> tuple[dist.Store, dist.Store]:
    """(the base TCPStore, the same sealed): hosted on our own socket, or a client of it."""
    td = datetime.timedelta(seconds=timeout_s)
    address = format_address(host, port)
    if is_host:
        # Our socket on the address's own interface: a taken port is a named error, not c10d's.
        fd = listen_socket(host, port, owner=where).detach()
        # multi_tenant, as torch's c10d backend: a second master in this process shares it.
        base = dist.TCPStore(
            host, port, None, True, td, wait_for_workers=False, multi_tenant=True,
            master_listen_fd=fd,
        )  # fmt: skip
        base.set(_SECRET_CHECK_KEY, _secret_check(secret))
    else:
        deadline = time.monotonic() + timeout_s
        wait_for_port(host, port, deadline, owner="the rendezvous host", me=where)
        base = dist.TCPStore(host, port, None, False, td)
        _check_same_secret(base, secret, address=address, where=where, timeout=td)
    return base, sealed(base, secret, where=f"{address} (the job's elastic rendezvous)")


def _check_same_secret(
    base: dist.Store, secret: bytes | None, *, address: str, where: str, timeout: datetime.timedelta
) -> None:
    try:
        base.wait([_SECRET_CHECK_KEY], timeout)
    except (RuntimeError, TimeoutError) as e:
        raise RendezvousError(
            f"{where} reached {address}, but it holds no stratagem rendezvous (no record under "
            f"{_SECRET_CHECK_KEY!r} within {timeout.total_seconds():g}s: {e}); is the "
            "rendezvous endpoint another program's port?"
        ) from None
    theirs, mine = bytes(base.get(_SECRET_CHECK_KEY)), _secret_check(secret)
    if hmac.compare_digest(theirs, mine):
        return
    if theirs == _INSECURE_CHECK:
        why = "runs without a job secret (STRATAGEM_INSECURE=1), and this node has one"
    elif secret is None:
        why = "is sealed with a job secret, and this node runs without one"
    else:
        why = "was made with another job secret than this node's"
    raise RendezvousError(
        f"{where} cannot join the rendezvous at {address}: it {why}. Every node of a job needs "
        "the same STRATAGEM_JOB_SECRET (or STRATAGEM_JOB_SECRET_FILE); a process without it "
        "may also have overwritten the rendezvous"
    )


def sealed_handler(
    *,
    host: str,
    port: int,
    is_host: bool,
    secret: bytes | None,
    run_id: str | None,
    min_nodes: int,
    max_nodes: int,
    join_timeout_s: float = 600,
    last_call_s: float = 30,
    close_timeout_s: float = 30,
    heartbeat_s: float = 5,
    keep_alive_max_attempt: int = 3,
    read_timeout_s: float = 60,
    local_addr: str | None = None,
    where: str,
) -> SealedRendezvous:
    """torch's dynamic rendezvous for ``min_nodes``..``max_nodes`` nodes, over the store at
    ``host:port`` (hosted here when ``is_host``), sealed with ``secret`` (None: insecure).

    ``where`` names this node in errors. ``run_id`` None: ``run_id_for(secret)``. Timeouts as
    torch's (join, last call, close), ``heartbeat_s`` its keep-alive interval and the time one
    heartbeat may take; ``read_timeout_s`` bounds each store operation (torch's 60 s)."""
    run_id = run_id or run_id_for(secret)
    base, store = _open_store(
        host, port, is_host=is_host, secret=secret, timeout_s=read_timeout_s, where=where
    )
    backend = C10dRendezvousBackend(store, run_id)
    # from_backend rather than create_handler: the same handler, with timeouts in seconds as
    # floats (create_handler reads whole seconds from RendezvousParameters' strings).
    torch_handler = DynamicRendezvousHandler.from_backend(
        run_id,
        store,
        backend,
        min_nodes,
        max_nodes,
        local_addr,
        RendezvousTimeout(
            join=datetime.timedelta(seconds=join_timeout_s),
            last_call=datetime.timedelta(seconds=last_call_s),
            close=datetime.timedelta(seconds=close_timeout_s),
            heartbeat=datetime.timedelta(seconds=heartbeat_s),
        ),
        keep_alive_interval=heartbeat_s,  # type: ignore[arg-type]  # a timedelta's seconds
        keep_alive_max_attempt=keep_alive_max_attempt,
    )
    os.environ[SHARE_STORE_VARIABLE] = "1"
    return SealedRendezvous(
        torch_handler, base_store=base, store=store, host=host, port=port, where=where
    )


def _seconds(params: RendezvousParameters, key: str, default: float) -> float:
    raw = params.get(key)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0:
        raise ClusterConfigError(
            f"rendezvous option {key}={raw!r}: expected a positive number of seconds"
        )
    return value


def create_handler(params: RendezvousParameters) -> SealedRendezvous:
    """torch's ``RendezvousHandlerCreator`` for the backend ``"stratagem"``.

    Reads torch's c10d options (``join_timeout``, ``last_call_timeout``, ``close_timeout``,
    ``keep_alive_interval``, ``keep_alive_max_attempt``, ``read_timeout``, ``is_host``) and the
    job's secret by ``cluster.job_secret``'s rules for a job whose store is ``endpoint``."""
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=DEFAULT_PORT)
    where = f"the node at {params.local_addr or os.uname().nodename} (pid {os.getpid()})"
    secret = find_job_secret([host], me=where)
    attempts = params.get_as_int("keep_alive_max_attempt", 3)
    kwargs = dict(
        host=host,
        port=port,
        secret=secret,
        run_id=None if params.run_id in _UNSET_RUN_IDS else params.run_id,
        min_nodes=params.min_nodes,
        max_nodes=params.max_nodes,
        join_timeout_s=_seconds(params, "join_timeout", 600),
        last_call_s=_seconds(params, "last_call_timeout", 30),
        close_timeout_s=_seconds(params, "close_timeout", 30),
        heartbeat_s=_seconds(params, "keep_alive_interval", 5),
        keep_alive_max_attempt=3 if attempts is None else attempts,
        read_timeout_s=_seconds(params, "read_timeout", 60),
        local_addr=params.local_addr,
        where=where,
    )
    is_host = params.get_as_bool("is_host")
    if is_host is not None:
        return sealed_handler(is_host=is_host, **kwargs)  # type: ignore[arg-type]
    if bind_all_requested():
        raise ClusterConfigError(
            f"{where}: with STRATAGEM_BIND_ALL=1 every node could host the rendezvous at "
            f"{format_address(host, port)}; say which one does with --rdzv-conf is_host=1 "
            "(is_host=0 on the others)"
        )
    # As torch's c10d backend: host when the endpoint is this machine's and its port free,
    # else join whoever hosts it (another node, or another agent on this machine).
    try:
        return sealed_handler(is_host=True, **kwargs)  # type: ignore[arg-type]
    except RendezvousError:
        return sealed_handler(is_host=False, **kwargs)  # type: ignore[arg-type]
