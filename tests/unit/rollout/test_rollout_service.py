"""The rollout service as a real process, with the test playing buffer and learner.

The test binds the data ROUTER (acking frames as a buffer does) and the weights publisher; a
``teamrl rollout`` child runs the addition-duo workflow on vLLM. Checked: /healthz and /readyz;
frames are whole groups of valid trajectories; bad announcements (checksum, corrupt payload,
missing folder, a probe that does not match) are refused with their reason counted on /metrics
while generation goes on at the old version; a good adapter switches the recorded version; SIGTERM
drains, exits 0, and every episode the service says it published arrived, none in part.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from teamrl.protocol import ports
from teamrl.protocol.adapters import adapters_sha256, write_adapter_payload
from teamrl.protocol.codec import decode_trajectories
from teamrl.protocol.control import InlineWeights, Probe, UriWeights, WeightsPublished
from teamrl.protocol.zmq_transport import WeightsPublisher, ZmqDataReceiver, latest_endpoint_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("embedded_model")]

PROMPT = [1, 16, 2, 3, 12, 4, 5, 13]  # <bos>S01+23=
COMPLETION = [2, 4, 6, 14]  # 024;
GROUP = 2


def free_port(pair: bool = False) -> int:
    return ports.free_port(2 if pair else 1)


def make_adapters(model_dir: Path, out: Path) -> tuple[dict[str, Path], list[float]]:
    """Two random non-zero LoRA adapters in PEFT format, and the solver's probe log-probs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft = get_peft_model(model, lora, adapter_name="solver-lora")
    peft.add_adapter("verifier-lora", lora)
    gen = torch.Generator().manual_seed(0)
    for name, p in peft.named_parameters():
        if "lora_B" in name:
            p.data.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    peft.save_pretrained(out)  # non-default adapters land in out/<name>/
    peft.set_adapter("solver-lora")
    with torch.no_grad():
        lp = torch.log_softmax(peft(torch.tensor([PROMPT + COMPLETION])).logits[0].float(), -1)
    expected = [lp[len(PROMPT) - 1 + j, t].item() for j, t in enumerate(COMPLETION)]
    return {"solver-lora": out / "solver-lora", "verifier-lora": out / "verifier-lora"}, expected


def announcement(version: int, location, sha: str, expected: list[float]) -> WeightsPublished:
    return WeightsPublished(
        announce_seq=0,
        version=version,
        adapters={"solver-lora": "solver-lora", "verifier-lora": "verifier-lora"},
        location=location,
        sha256=sha,
        probe=Probe(prompt_ids=PROMPT, completion_ids=COMPLETION, expected_logprobs=expected, atol=1e-3),
    )


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def metric(port: int, name: str, labels: str = "") -> float:
    _, text = http_get(port, "/metrics")
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} ([0-9.e+-]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


class FrameCollector:
    """The test's side of a rollout's data link: receive and ack its frames (decoded, in order)
    while waiting for a condition; the rollout's log on failure or exit."""

    def __init__(self, receiver, proc: subprocess.Popen, log: Path) -> None:
        self.receiver, self.proc, self.log = receiver, proc, log
        self.frames: list[list] = []

    def pump(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            f = self.receiver.recv(100)
            if f is not None:
                self.frames.append(decode_trajectories(f.payload))
                self.receiver.ack(f)

    def wait(self, pred, seconds: float, what: str) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if pred():
                return
            self.pump(0.5)
            assert self.proc.poll() is None, self.log.read_text()[-4000:]
        raise AssertionError(f"timed out waiting for {what}\n{self.log.read_text()[-3000:]}")

    def drain(self) -> None:
        """SIGTERM the rollout and take every frame it flushes until it exits (with code 0)."""
        self.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 120
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.pump(0.2)
        self.pump(1.0)
        assert self.proc.returncode == 0, self.log.read_text()[-3000:]


def test_rollout_service_publishes_groups_refuses_bad_adapters_and_drains(tmp_path: Path) -> None:
    from teamrl.learner.modelbuild import build

    model = build()
    folders, expected = make_adapters(model, tmp_path / "adapters")
    payload = write_adapter_payload(folders)
    sha = hashlib.sha256(payload).hexdigest()

    data_ep = f"tcp://127.0.0.1:{free_port()}"
    pub_ep = f"tcp://127.0.0.1:{free_port(pair=True)}"
    receiver = ZmqDataReceiver(data_ep)
    publisher = WeightsPublisher(pub_ep, latest_endpoint_for(pub_ep))
    mport = free_port()
    log = tmp_path / "rollout.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "teamrl.cli.main",
            "rollout",
            "--insecure",  # plaintext links: this test's buffer and publisher have no CURVE keys
            "--buffer",
            data_ep,
            "--weights",
            pub_ep,
            "--metrics-port",
            str(mport),
            "--set",
            "workflow=addition-duo",
            "--set",
            f"group_size={GROUP}",
            "--set",
            "groups_in_flight=4",
            "--set",
            "drain_timeout_s=0.0",
            "--set",
            f'adapter_dir="{tmp_path / "recv"}"',
        ],
        stdout=open(log, "wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ},
    )
    collector = FrameCollector(receiver, proc, log)
    frames, wait = collector.frames, collector.wait

    try:
        wait(lambda: http_get(mport, "/readyz")[0] == 200, 300, "/readyz")
        assert http_get(mport, "/healthz")[0] == 200
        wait(lambda: len(frames) >= 3, 60, "first frames")

        bad = [
            ("checksum", announcement(1, InlineWeights(chunks=[payload]), "0" * 64, expected)),
            (
                "corrupt",
                announcement(
                    1,
                    InlineWeights(chunks=[b"not a tar" * 50]),
                    hashlib.sha256(b"not a tar" * 50).hexdigest(),
                    expected,
                ),
            ),
            ("missing", announcement(1, UriWeights(uri=str(tmp_path / "nowhere")), sha, expected)),
            (
                "probe_failed",
                announcement(1, InlineWeights(chunks=[payload]), sha, [e - 1.0 for e in expected]),
            ),
        ]

        def refused_each(send, bad_items, counter: str, what: str) -> None:
            """Send each bad announcement, see its reason counted, then see generation go on."""
            for reason, msg in bad_items:
                send(msg)
                wait(
                    lambda r=reason: metric(mport, counter, f'{{reason="{r}"}}') >= 1,
                    60,
                    f"{what} refusal {reason}",
                )
            n_before = len(frames)
            wait(lambda: len(frames) > n_before + 2, 60, f"generation after the {what} refusals")

        refused_each(publisher.publish, bad, "teamrl_rollout_adapter_load_failures_total", "adapter")
        assert all(s.policy_version == 0 for fr in frames for t in fr for s in t.steps)

        publisher.publish(announcement(1, InlineWeights(chunks=[payload]), sha, expected))
        wait(
            lambda: any(s.policy_version == 1 for t in frames[-1] for s in t.steps),
            120,
            "frames sampled at v1",
        )
        assert metric(mport, "teamrl_rollout_policy_version", '{agent="solver-lora"}') == 1
        # the shared-folder route: the files copied into the rollout's adapter_dir, the copy checked
        # and loaded; the learner may prune its folder (it keeps 8 versions) and generation goes on
        shared = UriWeights(uri=str(folders["solver-lora"].parent))
        publisher.publish(announcement(2, shared, adapters_sha256(folders), expected))
        wait(
            lambda: any(s.policy_version == 2 for t in frames[-1] for s in t.steps),
            120,
            "frames sampled at v2 (loaded from a copy of the shared folder)",
        )
        copies = sorted(p.name for p in (tmp_path / "recv").iterdir())
        assert any(n.startswith("v2-") for n in copies), copies
        shutil.rmtree(folders["solver-lora"].parent)
        n_pruned = len(frames)
        wait(lambda: len(frames) > n_pruned + 2, 60, "generation after the shared folder was pruned")
        assert all(s.policy_version == 2 for t in frames[-1] for s in t.steps)

        # LangMARL profile announcements on the same socket: each bad one refused by reason, counted
        from teamrl.protocol.control import ProfilesPublished
        from teamrl.rewards.profiles import profiles_sha256

        def profiles_msg(version: int, profiles: dict, sha: str | None = None) -> ProfilesPublished:
            return ProfilesPublished(
                version=version, profiles=profiles, sha256=sha or profiles_sha256(version, profiles)
            )

        bad_profiles = [
            ("sha_mismatch", profiles_msg(1, {"solver": "S"}, sha="0" * 64)),
            ("unknown_agent", profiles_msg(2, {"planner": "S"})),
            ("untokenizable", profiles_msg(3, {"solver": "You are the solver."})),  # not the char vocabulary
        ]
        refused_each(
            publisher.publish_profiles, bad_profiles, "teamrl_profile_updates_refused_total", "profile"
        )
        assert not any("profile_version" in t.metadata for t in frames[-1])

        collector.drain()
    finally:
        if proc.poll() is None:
            proc.kill()
        publisher.close()
        receiver.close()
    text = log.read_text()
    m = re.search(r"rollout stopped: (\d+) groups, (\d+) episodes published; 0 frames un-acknowledged", text)
    assert m, text[-3000:]
    assert int(m.group(2)) == sum(len(fr) for fr in frames), "an episode was lost or duplicated"
    for fr in frames:  # whole groups only, each episode a valid solver -> verifier graph
        assert len(fr) == GROUP and len({t.group_id for t in fr}) == 1
        for t in fr:
            assert [s.agent_id for s in t.steps] == ["solver", "verifier"]
            assert list(t.steps[1].parents) == [0]
            assert len(t.steps[0].response_ids) == len(t.steps[0].logprobs) > 0
