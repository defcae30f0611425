"""Nothing left behind by a sandbox run (issue 30 item 4): the process that starts ``bwrap`` waits for it
and for what it started. A subprocess makes itself a child subreaper, so anything a run orphans
would be reparented to it instead of to PID 1 (tini, or a kernel that reaps), and counts what is
left after a normal run and after a timeout: before the fix each run left a ``bwrap`` zombie."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from teamrl.rewards.sandbox import namespace_sandbox_available

SCRIPT = r"""
import ctypes, json, os, time
ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
from teamrl.rewards.sandbox import Limits, Step, run_python, namespace_sandbox_available

def left():
    out = []
    for p in os.listdir("/proc"):
        try:
            stat = open(f"/proc/{p}/stat").read() if p.isdigit() else ""
        except OSError:
            continue
        if stat and int(stat[stat.rindex(")") + 2 :].split()[1]) == os.getpid():
            out.append(stat[stat.index("(") + 1 : stat.rindex(")")] + ":" + stat[stat.rindex(")") + 2])
    return out

namespace_sandbox_available()  # the probe run too
done = run_python("print(1)", [Step("test", "pass")], Limits(isolation="namespace"))
hung = run_python("while True: pass", [Step("test", "pass")], Limits(isolation="namespace", timeout_s=1.0))
time.sleep(0.3)
print(json.dumps({"rc": [done.returncode, hung.returncode], "timed_out": hung.timed_out, "left": left()}))
"""


@pytest.mark.skipif(not namespace_sandbox_available()[0], reason="no bubblewrap namespace sandbox here")
def test_a_sandbox_run_leaves_no_process_behind() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    print(got)
    assert got["rc"][0] == 0 and got["timed_out"]
    assert got["left"] == []
