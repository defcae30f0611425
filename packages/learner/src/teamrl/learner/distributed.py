"""torch.distributed through DeepSpeed for the learner ranks, and the DeepSpeed CPU op it needs.

``init_distributed`` reads the rendezvous from the environment (a world of one without it);
``_load_cpu_comm_op`` builds or loads DeepSpeed's CPU communication op under a lock that survives a
killed builder; ``_all_reduce_max`` and ``_barrier`` are the engine's collectives.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from teamrl.protocol.ports import free_port


def init_distributed(device: str = "cpu") -> tuple[int, int]:
    """Initialise torch.distributed through DeepSpeed; returns (rank, world_size).

    Reads RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT / LOCAL_RANK (what ``teamrl run``, ``torchrun``
    and the ``deepspeed`` launcher set). Without them this is a world of one on a free local port;
    the variables it sets for that are removed again once the group is up, so that no process this
    one starts later (a ``teamrl run`` from a notebook or a test) inherits a rendezvous on a port
    this process holds. gloo on CPU, nccl on CUDA.
    """
    if device == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    lent: list[str] = []
    if "WORLD_SIZE" not in os.environ:
        lent = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
    # the GPU index on this host, not the global rank: a one-GPU pod of rank 1 has only cuda:0
    os.environ.setdefault("LOCAL_RANK", "0")
    if os.environ.get("MASTER_ADDR", "").startswith(("127.", "localhost")):
        # All ranks on this host: gloo must not pick its interface by resolving the hostname, which
        # in a container or a network namespace can name an address that is not up (ranks then wait).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # One build folder per environment: two venvs sharing ~/.cache/torch_extensions rebuild the op
    # over each other (the build file names the venv's paths) and race for the same lock.
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))
    _load_cpu_comm_op(float(os.environ.get("TEAMRL_OP_BUILD_TIMEOUT_S", OP_BUILD_WAIT_S)))
    import deepspeed
    import torch.distributed as dist

    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", verbose=False)
    for key in lent:  # the group is up: nothing reads them again (DeepSpeed checks is_initialized)
        os.environ.pop(key, None)
    return dist.get_rank(), dist.get_world_size()


OP_BUILD_WAIT_S = 900.0  # the CPU op builds in about a minute on 2 idle cores, several on busy ones
OP_BUILD_LOG_S = 5.0  # a learner waiting for the build says so this often
FOREIGN_LOCK_S = 300.0  # a torch build lock with no teamrl owner record is taken over at this age
OP_NAME = "deepspeed_shm_comm"


def _load_cpu_comm_op(timeout_s: float) -> None:
    """Build or load DeepSpeed's CPU communication op before ``deepspeed.init_distributed`` needs it.

    DeepSpeed JIT-builds the op (``deepspeed_shm_comm``) into ``TORCH_EXTENSIONS_DIR`` under torch's
    file lock, which a build killed half-way leaves behind; torch then waits on it for ever, silently
    (seen: ``teamrl run`` idle for 17 minutes at start). ``scripts/setup.sh`` builds it once; here the
    load runs under a teamrl lock next to the build folder (``deepspeed_shm_comm.teamrl-owner``, an
    ``fcntl`` lock the kernel drops when its holder dies, holding the holder's pid):

    * a learner that finds the lock held waits at most ``timeout_s`` (``TEAMRL_OP_BUILD_TIMEOUT_S``),
      logging every ``OP_BUILD_LOG_S`` which pid it waits for and for how long, then fails;
    * whoever holds it knows no other teamrl process is building, so a torch lock it finds was left by
      a dead owner (the pid recorded is gone) and is removed at once; one with no dead teamrl owner
      on record (another program) is waited for, logged, and taken over at ``FOREIGN_LOCK_S`` old.

    Ranks on one host load in turn (the first builds, the rest load the result); the rendezvous comes
    after, so they never wait on each other here. Nothing is done where DeepSpeed would not build the
    op (another accelerator, or an incompatible host)."""
    import fcntl
    import logging

    log = logging.getLogger("teamrl.learner")
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return  # as deepspeed.comm.torch.build_shm_op decides
    root = Path(os.environ["TORCH_EXTENSIONS_DIR"])
    root.mkdir(parents=True, exist_ok=True)
    owner_file = root / f"{OP_NAME}.teamrl-owner"
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with open(owner_file, "a+") as owner:
        _lock_owner_file(owner, owner_file, t0, timeout_s, log)
        try:
            previous = _recorded_pid(owner_file)
            _clear_dead_build_lock(root, previous, deadline, log)
            owner.seek(0)
            owner.truncate()
            owner.write(f"{os.getpid()}\n")
            owner.flush()
            if time.monotonic() - t0 > OP_BUILD_LOG_S:
                log.info("DeepSpeed CPU op: lock taken after %.0f s; loading", time.monotonic() - t0)
            builder.load(verbose=False)  # builds on the first call in this folder, then loads
        finally:
            fcntl.flock(owner, fcntl.LOCK_UN)


def _lock_owner_file(owner: Any, owner_file: Path, t0: float, timeout_s: float, log: Any) -> None:
    """Take the teamrl lock on the open ``owner_file``, waiting for its holder at most ``timeout_s``
    from ``t0`` (then ``TimeoutError``) and logging the wait every ``OP_BUILD_LOG_S``."""
    import fcntl

    deadline = t0 + timeout_s
    next_log = t0 + OP_BUILD_LOG_S
    while True:
        try:
            fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            holder = _recorded_pid(owner_file)
            if now >= deadline:
                raise TimeoutError(
                    f"the DeepSpeed CPU op build by pid {holder} ({owner_file}) did not finish "
                    f"in {timeout_s:.0f} s (TEAMRL_OP_BUILD_TIMEOUT_S)"
                ) from None
            if now >= next_log:
                next_log = now + OP_BUILD_LOG_S
                log.warning(
                    "waiting %.0f s for the DeepSpeed CPU op build by pid %s (%s)",
                    now - t0,
                    holder,
                    owner_file,
                )
            time.sleep(0.2)


def _recorded_pid(owner_file: Path) -> int | None:
    try:
        text = owner_file.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _processes_in(folder: Path) -> list[int]:
    """Pids whose working folder is ``folder`` (torch runs ninja and the compiler there); Linux only."""
    found = []
    try:
        target = folder.resolve()
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if name.isdigit() and int(name) != os.getpid():
            try:
                if Path(os.readlink(f"/proc/{name}/cwd")) == target:
                    found.append(int(name))
            except OSError:
                continue
    return found


def _clear_dead_build_lock(root: Path, previous: int | None, deadline: float, log: Any) -> None:
    """Remove torch's build lock of the op once its owner is dead (called holding the teamrl lock).

    Dead: the pid on record is gone and no process is still compiling in the build folder (a killed
    learner's ninja goes on alone). A lock with no dead teamrl owner on record belongs to another
    program: it is taken over at ``FOREIGN_LOCK_S`` old. Meanwhile the wait is logged and bounded."""
    t0 = time.monotonic()
    next_log = t0 + OP_BUILD_LOG_S
    owner_dead = previous is not None and previous != os.getpid() and not _pid_alive(previous)
    while True:
        batons = [p for p in (root / OP_NAME / "lock", *root.glob(f"*/{OP_NAME}/lock")) if p.exists()]
        if not batons:
            return
        baton = batons[0]
        try:
            age = time.time() - baton.stat().st_mtime
        except OSError:
            continue  # released meanwhile
        building = _processes_in(baton.parent)
        if not building and (owner_dead or age > FOREIGN_LOCK_S):
            with contextlib.suppress(FileNotFoundError):
                baton.unlink()
            log.warning(
                "took over the build lock %s (%.0f s old) left by %s",
                baton,
                age,
                f"pid {previous}, which is dead" if owner_dead else "a program with no teamrl owner record",
            )
            continue
        if building:
            why = f"pids {building} still compiling in {baton.parent}"
        else:
            why = f"{baton} held by a program with no teamrl owner record ({age:.0f} s old)"
        now = time.monotonic()
        if now >= deadline:
            raise TimeoutError(f"DeepSpeed CPU op: gave up after {now - t0:.0f} s waiting for {why}")
        if now >= next_log:
            next_log = now + OP_BUILD_LOG_S
            log.warning("DeepSpeed CPU op: waiting %.0f s for %s", now - t0, why)
        time.sleep(0.2)


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce_max(values: list[int]) -> list[int]:
    import torch.distributed as dist

    if _world()[1] == 1:
        return values
    t = torch.tensor(values, dtype=torch.long)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def _barrier() -> None:
    import torch.distributed as dist

    if _world()[1] > 1:
        dist.barrier()
