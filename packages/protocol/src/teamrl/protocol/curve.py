"""CURVE keys of a run: one keypair per role in one folder, and who may connect to which socket.

Layout (the same as the Kubernetes Secret that ``deploy/scripts/curve_secret.py`` prints, mounted
at ``/etc/teamrl-curve``): ``<role>.pub`` holds the role's z85 public key, ``<role>.key`` its z85
secret key (mode 0600). Roles: ``buffer`` and ``learner`` are servers (the buffer's data and RPC
sockets; the learner's weights PUB and "latest" sockets) and clients (the learner samples from the
buffer); ``rollout`` is a client of both; ``admin`` is the operator's key, the only one besides the
buffer's local admin socket that may send ``Drain``/``Shutdown``.

Who may connect (the ZAP allow-list each server socket gets; docs/transport-security.md):

* buffer data (trajectories in): ``rollout``
* buffer RPC (sample, stats, hello/heartbeat, drain/shutdown): ``learner``, ``rollout``, ``admin``;
  the buffer then authorises by role (``role_of``): only ``admin`` may drain or stop it, and only
  ``learner`` announces policy versions (``VersionAnnounce``; docs/security.md)
* learner weights PUB and "latest": ``rollout``, ``admin``

What each role may then ask the buffer's RPC socket (``BUFFER_RPC_RIGHTS``, by message ``type``;
the buffer refuses anything else as ``not_authorised``, or ``not_admin`` for ``Drain``/``Shutdown``):
``rollout`` Hello (as ``service="rollout"``) and Heartbeat; ``learner`` SampleRequest,
BufferStatsRequest and VersionAnnounce; ``admin`` BufferStatsRequest, Drain and Shutdown. Without CURVE the buffer
cannot tell roles apart: every peer may send everything but Drain/Shutdown, which only the local
admin socket accepts.

Call sequence (the run launcher, once per run; services read the folder through ``[transport]``)::

    keys_dir = generate_run_keys(run_dir / "curve")      # -> run_dir / "curve"
    # every service: [transport] curve = true, curve_dir = "<keys_dir>"
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from teamrl.protocol.transport import CurveKeys

ROLES = ("buffer", "learner", "rollout", "admin")
ALLOWED: dict[str, tuple[str, ...]] = {
    "buffer_data": ("rollout",),
    "buffer_rpc": ("learner", "rollout", "admin"),
    "learner_weights": ("rollout", "admin"),
}
SERVER_ROLE = {"buffer_data": "buffer", "buffer_rpc": "buffer", "learner_weights": "learner"}
# Per-message authorisation on the buffer's RPC socket: role -> the control message types it may send.
BUFFER_RPC_RIGHTS: dict[str, frozenset[str]] = {
    "rollout": frozenset({"hello", "heartbeat"}),
    "learner": frozenset({"sample_request", "buffer_stats_request", "version_announce"}),
    "admin": frozenset({"buffer_stats_request", "drain", "shutdown"}),
}


class CurveKeyError(ValueError):
    """A key file is missing or malformed; the message names the file."""


def generate_run_keys(directory: str | Path) -> Path:
    """Write a fresh keypair per role into ``directory`` (created 0700; secret files 0600) and
    return it. Existing files are replaced, so calling it again rotates every key."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o700)
    for role in ROLES:
        public, secret = zmq.curve_keypair()
        _write(path / f"{role}.pub", public, 0o644)
        _write(path / f"{role}.key", secret, 0o600)
    return path


def _write(path: Path, data: bytes, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data + b"\n")
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _read_key(path: Path) -> bytes:
    try:
        key = path.read_bytes().strip()
    except OSError as e:
        raise CurveKeyError(f"CURVE key file {path}: {e.strerror or e}") from e
    if len(key) != 40:
        raise CurveKeyError(f"CURVE key file {path}: expected a 40-character z85 key, got {len(key)} bytes")
    return key


def public_key(directory: Path, role: str) -> bytes:
    return _read_key(directory / f"{role}.pub")


def server_keys(directory: Path, socket: str) -> CurveKeys:
    """Keys for the server side of ``socket`` (a key of ``ALLOWED``): its role's pair and the
    public keys of the roles allowed to connect."""
    role = SERVER_ROLE[socket]
    allowed = frozenset(
        public_key(directory, r) for r in ALLOWED[socket] if (directory / f"{r}.pub").exists()
    )
    return CurveKeys(
        public=public_key(directory, role),
        secret=_read_key(directory / f"{role}.key"),
        allowed_clients=allowed,
    )


def client_keys(directory: Path, role: str, socket: str) -> CurveKeys:
    """Keys for ``role`` dialling ``socket``: its own pair and the server's public key."""
    return CurveKeys(
        public=public_key(directory, role),
        secret=_read_key(directory / f"{role}.key"),
        server_public=public_key(directory, SERVER_ROLE[socket]),
    )


def role_of(directory: Path, z85_public: str | bytes) -> str | None:
    """The role whose public key this is (as ZAP reports it in ``User-Id``), else None."""
    key = z85_public.encode() if isinstance(z85_public, str) else z85_public
    for role in ROLES:
        p = directory / f"{role}.pub"
        if p.exists() and _read_key(p) == key:
            return role
    return None


def key_roles(directory: Path) -> dict[str, str]:
    """{z85 public key (as ZAP reports it in ``User-Id``): role} for every role key in ``directory``;
    read once by a server at start (a rotation restarts it anyway: its ZAP allow-list is fixed too)."""
    return {
        public_key(directory, role).decode(): role for role in ROLES if (directory / f"{role}.pub").exists()
    }


def keys_main(argv: list[str] | None = None) -> int:
    """``teamrl keys DIR``: a fresh keypair per role in ``DIR`` (0700, secret files 0600), then the
    ``[transport]`` table that makes a service use them."""
    import argparse

    p = argparse.ArgumentParser(
        prog="teamrl keys",
        description="Write a fresh CURVE keypair per role (buffer, learner, rollout, admin) into DIR and "
        "print the [transport] table every service's --config needs to use them. For Kubernetes, "
        "deploy/scripts/curve_secret.py prints the same keys as a Secret.",
    )
    p.add_argument("dir", metavar="DIR", help="folder to write (created; existing keys are replaced)")
    args = p.parse_args(argv)
    keys = generate_run_keys(args.dir).resolve()
    print(f'[transport]\ncurve = true\ncurve_dir = "{keys}"')
    return 0
