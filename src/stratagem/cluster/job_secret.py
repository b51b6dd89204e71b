"""The job's secret: what proves that a process belongs to the job.

Every process of a job holds the same secret: the rendezvous store's records are sealed with it
(``comm.sealed_store``) and every connection to a task answers a challenge with it, so a process
without it cannot join, claim a task or send anything a task acts on. First found wins:

1. ``STRATAGEM_JOB_SECRET``: the secret itself (at least 16 characters); ``stratagem run`` makes
   a fresh random one for each job and gives it to every task it starts;
2. ``STRATAGEM_JOB_SECRET_FILE``: a file holding it (readable by its owner only);
3. a job whose tasks are all on this machine: this user's own file,
   ``$XDG_CACHE_HOME/stratagem/job-secret`` (else ``~/.cache/...``), made with mode 0600.

A job on several machines without 1 or 2 is refused, unless ``STRATAGEM_INSECURE=1`` says to
run without one (then anyone who can reach the job's ports can join it).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path

from stratagem.cluster.address import is_loopback, parse_address
from stratagem.cluster.cluster_spec import ClusterSpec
from stratagem.errors import ClusterConfigError

SECRET_VARIABLE = "STRATAGEM_JOB_SECRET"
SECRET_FILE_VARIABLE = "STRATAGEM_JOB_SECRET_FILE"
INSECURE_VARIABLE = "STRATAGEM_INSECURE"
_MIN_CHARS = 16


def new_secret() -> str:
    """A fresh secret for one job (256 random bits, as hex)."""
    return secrets.token_hex(32)


def _on_this_machine(host: str) -> bool:
    """Whether ``host`` is this machine: loopback, or an address this machine can bind."""
    host = host.strip("[]")
    if is_loopback(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False  # unresolvable here: not a name of this machine
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                probe.bind((sockaddr[0], 0))
            return True
        except OSError:
            continue
    return False


def _does_not_resolve(host: str) -> str | None:
    """Why ``host`` does not resolve here, or None when it does."""
    try:
        socket.getaddrinfo(host.strip("[]"), None, type=socket.SOCK_STREAM)
    except OSError as e:
        return str(e.strerror or e)
    return None


def insecure_requested(environ: Mapping[str, str] | None = None) -> bool:
    raw = (os.environ if environ is None else environ).get(INSECURE_VARIABLE, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes", "insecure"):
        return True
    raise ClusterConfigError(
        f"{INSECURE_VARIABLE}={raw!r}: expected 1 (run without a job secret) or 0"
    )


def _checked(secret: str, where: str) -> bytes:
    secret = secret.strip()
    if len(secret) < _MIN_CHARS:
        raise ClusterConfigError(
            f"the job secret from {where} has {len(secret)} characters; expected at least "
            f"{_MIN_CHARS} (`python -c 'import secrets; print(secrets.token_hex(32))'` makes one)"
        )
    return secret.encode("utf-8")


def _read_file(path: Path, where: str) -> bytes:
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ClusterConfigError(f"cannot read the job secret file {where}: {e}") from None
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterConfigError(
            f"the job secret file {where} is readable by others (mode "
            f"{stat.S_IMODE(info.st_mode):o}); make it readable by its owner only "
            f"(chmod 600 {path})"
        )
    return _checked(text, where)


def user_secret_path() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "stratagem" / "job-secret"


def _user_secret() -> bytes:
    """This user's own secret for jobs on this machine, made on first use.

    Written whole under a private name, then linked into place: a task never sees the file
    empty, and of two tasks making it at once, the first link wins and both read that one."""
    path = user_secret_path()
    if not path.exists():
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            staged = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(staged, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(new_secret() + "\n")
            try:
                os.link(staged, path)
            except FileExistsError:
                pass  # another task of the job made it first: read theirs
            finally:
                staged.unlink()
        except OSError as e:
            raise ClusterConfigError(
                f"cannot make this user's job secret file {path} ({e}); set "
                f"{SECRET_VARIABLE} (or {SECRET_FILE_VARIABLE}) for the job instead"
            ) from None
    return _read_file(path, str(path))


def given_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The secret the user gave (``STRATAGEM_JOB_SECRET`` or ``..._FILE``), else None."""
    env = os.environ if environ is None else environ
    raw = env.get(SECRET_VARIABLE, "")
    if raw.strip():
        return _checked(raw, f"${SECRET_VARIABLE}")
    path = env.get(SECRET_FILE_VARIABLE, "").strip()
    if path:
        return _read_file(Path(path).expanduser(), f"${SECRET_FILE_VARIABLE} ({path})")
    return None


def job_secret(hosts: Iterable[str], *, me: str) -> bytes | None:
    """The secret of the job whose tasks run on ``hosts``, or None when running insecure.

    ``me`` names this task in the error for a multi-machine job without a secret."""
    given = given_secret()
    if given is not None:
        return given
    if insecure_requested():
        return None
    remote = sorted({h for h in hosts if not _on_this_machine(h)})
    unresolved = {h: why for h in remote if (why := _does_not_resolve(h)) is not None}
    if unresolved:
        # Not another machine: a name nobody can reach, so asking for a secret would send the
        # user after the wrong fix.
        names = "; ".join(f"{h!r} ({why})" for h, why in sorted(unresolved.items()))
        raise ClusterConfigError(
            f"{me}: the cluster's host names do not resolve on this machine: {names}. Use "
            "names this machine's resolver knows (or IP addresses) in the cluster (TF_CONFIG, "
            "--host), or add them to its name service (/etc/hosts)"
        )
    if remote:
        raise ClusterConfigError(
            f"{me} is part of a job on several machines ({', '.join(remote)}) but has no job "
            f"secret: set {SECRET_VARIABLE} (the same value on every machine) or "
            f"{SECRET_FILE_VARIABLE}, or {INSECURE_VARIABLE}=1 to let anyone who can reach the "
            "job's ports join it"
        )
    return _user_secret()


def task_hosts(spec: ClusterSpec) -> list[str]:
    """The hosts of every task of ``spec``: which machines a job spans. torchrun's spec knows
    only its rendezvous host (the others are placeholders such as ``<torchrun rank 1>``): on a
    multi-node torchrun job the nodes whose MASTER_ADDR is another machine are refused without
    a secret, which tells the user to give the same one to every node."""
    addresses = [
        spec.task_address(job, index) for job in spec.jobs for index in spec.task_indices(job)
    ]
    return [parse_address(a)[0] for a in addresses if not a.startswith("<")]


def key_for(secret: bytes, purpose: str) -> bytes:
    """A key derived from the secret for one use, so that no two uses share a key."""
    return hmac.new(secret, b"stratagem/" + purpose.encode("utf-8"), hashlib.sha256).digest()


def proof(secret: bytes, challenge: bytes, who: str) -> bytes:
    """The answer to a connection's ``challenge`` by the task ``who``: HMAC-SHA256."""
    return hmac.new(
        key_for(secret, "connection"), challenge + b"|" + who.encode("utf-8"), hashlib.sha256
    ).digest()


def proof_ok(secret: bytes, challenge: bytes, who: str, answer: bytes) -> bool:
    return hmac.compare_digest(proof(secret, challenge, who), answer)
