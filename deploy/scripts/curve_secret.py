"""Print a Kubernetes Secret holding fresh CURVE keypairs for the teamrl ZeroMQ links.

Design: keys are generated where they are applied and never written to the repository. The
layout is exactly the folder ``teamrl run`` makes for a local run (``RUN/curve``), because both come
from ``teamrl.protocol.curve.generate_run_keys``: ``<role>.pub`` (Z85 public key) and ``<role>.key``
(Z85 secret key) for the roles ``buffer``, ``learner``, ``rollout`` and ``admin``. Every pod mounts
the Secret at ``/etc/teamrl-curve`` and reads it through the ``[transport]`` table of
``deploy/config/teamrl.toml`` (``curve = true``, ``curve_dir = "/etc/teamrl-curve"``). Who may dial
which socket follows from the roles (``teamrl.protocol.curve.ALLOWED``): buffer data <- rollout;
buffer RPC <- learner, rollout, admin (only admin may Drain/Shutdown); learner weights PUB and
"latest" <- rollout, admin. A peer without an allowed key, or a plaintext one, is refused and
counted in ``teamrl_protocol_auth_refused_total{socket,reason}`` (docs/transport-security.md).

First install (the base ships the Secret empty; with it empty every pod fails at start)::

    python deploy/scripts/curve_secret.py | kubectl replace -f -

``replace`` rather than ``apply``: a Secret last written by ``kubectl apply`` loses its keys at the
next ``kubectl apply -k`` of the base, which lists it with no data. Check after each apply of the
base: ``kubectl -n teamrl get secret teamrl-curve -o jsonpath='{.data}'`` lists eight files.

Rotation (every key at once; services read their keys only at start)::

    python deploy/scripts/curve_secret.py --dir ~/.teamrl-curve-new | kubectl replace -f -
    kubectl -n teamrl rollout restart statefulset/buffer statefulset/learner deployment/rollout

The kubelet refreshes the mounted files within about a minute (the Secret is mounted whole, not by
``subPath``); restart once ``kubectl exec`` shows the new ``buffer.pub`` in a pod. While old and new
pods overlap, their links are refused and counted (``unknown_key``/``bad_handshake``); rollouts keep
un-acked frames and resend them once the buffer takes their new key, so no acked data is lost. To
revoke one role only, rotating everything is the supported path (the allow-lists are by role).
``--dir`` also writes the keys to a local folder (0700; secret files 0600): the operator's
``admin.key`` there is what an operator's client needs to Drain/Shutdown the buffer over CURVE.
"""

from __future__ import annotations

import argparse
import base64
import sys
import tempfile
from pathlib import Path


def make_keys(directory: Path) -> dict[str, bytes]:
    """Fresh keys in ``directory`` (``generate_run_keys``), returned as {file name: contents}."""
    try:
        from teamrl.protocol.curve import generate_run_keys  # the one definition of the layout
    except ImportError as e:  # --help works without it; generating needs teamrl-protocol and pyzmq
        raise SystemExit(f"curve_secret.py needs the teamrl protocol package and pyzmq: {e}") from None
    generate_run_keys(directory)
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.suffix in (".pub", ".key")}


def build_secret(name: str, namespace: str, files: dict[str, bytes]) -> str:
    """Return the Secret manifest (YAML text) holding ``files``."""
    lines = [
        "apiVersion: v1",
        "kind: Secret",
        "metadata:",
        f"  name: {name}",
        f"  namespace: {namespace}",
        "  labels:",
        "    app.kubernetes.io/part-of: teamrl",
        "type: Opaque",
        "data:",
    ]
    lines += [f"  {k}: {base64.b64encode(v).decode()}" for k, v in sorted(files.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Rotation and first install: see this script's docstring (python -m pydoc).",
    )
    p.add_argument("--name", default="teamrl-curve")
    p.add_argument("--namespace", default="teamrl")
    p.add_argument(
        "--dir",
        metavar="DIR",
        default=None,
        help="also keep the keys in DIR (e.g. for the operator's admin.key); default: nowhere on disk",
    )
    args = p.parse_args(argv)
    if args.dir:
        files = make_keys(Path(args.dir).expanduser())
    else:
        with tempfile.TemporaryDirectory(prefix="teamrl-curve-") as tmp:
            files = make_keys(Path(tmp) / "curve")
    sys.stdout.write(build_secret(args.name, args.namespace, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
