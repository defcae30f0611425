"""Print a Kubernetes Secret holding fresh CURVE keypairs for the teamrl ZeroMQ links.

Design: keys are generated where they are applied (``... | kubectl apply -f -``) and never
written to the repository. One keypair per role; the servers (buffer, learner publisher) get
the allow-list of client public keys their ZAP handler enforces (RELIABILITY.md R7: without an
allow-list CURVE accepts any client keypair). Files in the Secret, mounted at
/etc/teamrl-curve: ``<role>.key`` (Z85 secret key), ``<role>.pub`` (Z85 public key) and
``allowed_clients`` (one Z85 public key per line).
"""

from __future__ import annotations

import argparse
import base64
import sys

ROLES = ("buffer", "learner", "rollout")
CLIENT_ROLES = ("rollout", "learner")  # rollouts dial buffer+learner; learners dial the buffer


def build_secret(name: str, namespace: str) -> str:
    """Return the Secret manifest (YAML text) with one new keypair per role."""
    import zmq  # lazily: --help must not need pyzmq

    files: dict[str, bytes] = {}
    for role in ROLES:
        public, secret = zmq.curve_keypair()
        files[f"{role}.pub"] = public
        files[f"{role}.key"] = secret
    files["allowed_clients"] = b"".join(files[f"{r}.pub"] + b"\n" for r in CLIENT_ROLES)
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
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--name", default="teamrl-curve")
    p.add_argument("--namespace", default="teamrl")
    args = p.parse_args(argv)
    sys.stdout.write(build_secret(args.name, args.namespace))
    return 0


if __name__ == "__main__":
    sys.exit(main())
