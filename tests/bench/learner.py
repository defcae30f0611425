"""Learner benchmark: ``LearnerEngine.train_step`` against a bare PyTorch + PEFT loop, same run.

Both sides train the same LoRA config (r 8, alpha 16, q/k/v/o) on a copy of the same base, on the same
batch (``--rows`` agent steps of ``--prompt`` + ``--response`` tokens, one micro-batch), each update being
one forward over the rows, the PPO-clip loss on the response tokens, one backward and one AdamW step
with global grad-norm clipping at 1.0. Ours runs as the learner service runs it (one adapter, the
default decoupled objective, DeepSpeed ZeRO-2 engine, simultaneous update, so no extra no-grad pass)
and adds decoding the sample's Arrow frame, the rows gathered from its columns, advantages and its
metrics. Rounds alternate
bare / ours after a warm-up of each; the median of each side is printed, and the ratio is the median of
the per-round ratios (adjacent measurements, so drifting load from other processes cancels). On CPU
torch runs one thread by default (``--threads``) and the ratio is taken from process CPU time
(``--clock``), since wall time on a shared machine measures the neighbours. Not a timed test.

Then the weight push in shared-folder mode, as the services run it: ``export_adapters`` + sha256 of
the written files on the learner side; the files' sha256 checked in place + PEFT ``load_adapter``
from the same folder on a receiving copy of the base (no archive, no copy), until its probe
log-probs equal the learner's within the dtype's tolerance (:func:`push_atol`; ``--push-rank`` pushes
an adapter of another LoRA rank, from a learner built for it). The vLLM hot-load on a rollout is measured by the rollout benchmark
(``tests/bench/rollout.py``) and the rollout adapter tests, not here.

    python tests/bench/learner.py [--quick] [--model DIR] [--device cpu|cuda] [--random-init-qwen05b]
        [--rows N --prompt P --response R] [--push-rank 16] [--team]

``--team`` adds a two-adapter step: our sequential update (HAPPO factor) of two LoRA adapters on the
same base against the same update written by hand on a two-adapter PEFT model (the first adapter's
log-probs before its step (from its training forward) and after it (a no-grad pass), then the
second's step with the factor).

Last lines: ``team_ratio=<...>`` (with ``--team``) and ``learner_ratio=<ours/bare tokens per second>``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

ADAPTER = "solver-lora"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]
BF16_EPS = 2.0**-7  # torch.finfo(torch.bfloat16).eps


def push_atol(dtype: str) -> float:
    """Largest |receiver - learner| probe log-prob accepted: 1e-4 in float32, 8 eps (0.0625) in bfloat16.

    bf16 keeps 8 significand bits: a logit of magnitude 2-4 is only known to within 2**-6, and the
    same adapter computed by other kernels (the receiver's PEFT keeps LoRA weights in float32,
    DeepSpeed's bf16 engine casts them) lands a few such steps away: measured up to 0.029 on an H200
    with the 0.5B-shaped model. The same rule as the learner's publish probe
    (``teamrl.learner.service.probe_atol``).
    """
    return 8 * BF16_EPS if dtype == "bfloat16" else 1e-4


def _qwen05b_shaped(out: Path, dtype: str) -> Path:
    """A random-initialised model with Qwen2.5-0.5B's config (no download), saved to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(
        vocab_size=151_936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=151_643,
        eos_token_id=151_643,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        cfg, dtype=torch.bfloat16 if dtype == "bfloat16" else torch.float32
    )
    model.save_pretrained(out)
    return out


def _trajectories(
    rows: int, prompt: int, response: int, vocab: int, seed: int = 0, adapters: tuple[str, ...] = (ADAPTER,)
) -> list:
    """``rows`` agent steps of random tokens: ``rows / len(adapters)`` one-turn episodes in which
    each adapter's agent acts once, in order (the joint samples of the HAPPO factor)."""
    import numpy as np

    from teamrl.protocol.trajectory import AgentStep, GraphTrajectory

    rng = np.random.default_rng(seed)
    out = []
    for i in range(rows // len(adapters)):
        steps = [
            AgentStep(
                agent_id=adapter.removesuffix("-lora"),
                role=adapter.removesuffix("-lora"),
                model_id="bench",
                adapter=adapter,
                policy_version=0,
                turn=0,
                parents=np.arange(min(k, 1), dtype=np.int32) + max(k - 1, 0),
                prompt_ids=rng.integers(2, vocab, prompt, dtype=np.int32),
                response_ids=rng.integers(2, vocab, response, dtype=np.int32),
                logprobs=-rng.exponential(1.0, response).astype(np.float32),
                reward=float(rng.normal()),
            )
            for k, adapter in enumerate(adapters)
        ]
        out.append(GraphTrajectory(f"e{i}", "bench", i, f"t{i // 8}", f"g{i // 8}", "w", steps, reward=0.0))
    return out


class Bare:
    """The reference: PEFT model + torch AdamW, nothing else (the same math as one ``train_step``).

    With several adapters (one LoRA each on the same base, one AdamW each) ``step`` trains the one
    named, and ``happo`` is the sequential update written out by hand: the first adapter's log-probs
    before its step (its training forward's, detached) and after it (one no-grad pass) give the
    factor that weights the second one's advantages."""

    def __init__(
        self,
        model_dir: Path,
        device: str,
        dtype: str,
        lr: float,
        seed: int,
        adapters: tuple[str, ...] = (ADAPTER,),
    ) -> None:
        import torch
        from peft import LoraConfig, get_peft_model
        from transformers import AutoModelForCausalLM

        torch.manual_seed(seed)
        tdtype = torch.bfloat16 if dtype == "bfloat16" else torch.float32
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).to(device)
        lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, bias="none")
        self.model = get_peft_model(base, lora, adapter_name=adapters[0])
        for name in adapters[1:]:
            self.model.add_adapter(name, lora)
        named = list(self.model.named_parameters())
        self.params = {a: [p for n, p in named if f".{a}." in n] for a in adapters}
        self.opts = {
            a: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0, betas=(0.9, 0.999))
            for a, ps in self.params.items()
        }
        self.device = device

    def prepare(self, trajs: list, k: int = 0) -> dict:
        """Tensors of agent ``k``'s rows, built once outside the timed loop (the bare side's best case)."""
        import torch

        steps = [t.steps[k] for t in trajs]
        p, r = len(steps[0].prompt_ids), len(steps[0].response_ids)
        ids = torch.tensor([list(s.prompt_ids) + list(s.response_ids) for s in steps], dtype=torch.long)
        rewards = torch.tensor([s.reward for s in steps])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        return {
            "ids": ids.to(self.device),
            "pos": torch.arange(p + r, device=self.device).expand(len(steps), -1),
            "resp": ids[:, p:].to(self.device),
            "adv": adv[:, None].to(self.device),
            "p": p,
        }

    def _logp(self, b: dict):
        import torch

        p = b["p"]
        logits = self.model(input_ids=b["ids"], position_ids=b["pos"], use_cache=False).logits
        sel = logits[:, p - 1 : -1].float()
        return torch.log_softmax(sel, dim=-1).gather(-1, b["resp"][..., None]).squeeze(-1)

    def step(self, b: dict, adapter: str = ADAPTER, factor=None):
        """One PPO-clip step of ``adapter``; returns its log-probs before the step (detached, [rows])."""
        import torch

        self.model.set_adapter(adapter)
        self.model.train()
        logp = self._logp(b)
        ratio = torch.exp(logp - logp.detach())
        adv = b["adv"] if factor is None else b["adv"] * factor[:, None]
        loss = torch.maximum(-ratio * adv, -ratio.clamp(0.8, 1.2) * adv).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params[adapter], 1.0)
        self.opts[adapter].step()
        self.opts[adapter].zero_grad(set_to_none=True)
        return logp.detach().sum(-1)

    def happo(self, first: dict, second: dict, adapters: tuple[str, str]) -> None:
        import torch

        old = self.step(first, adapters[0])  # the training forward's log-probs are the old policy's
        self.model.eval()
        with torch.no_grad():
            new = self._logp(first).sum(-1)
        self.step(second, adapters[1], factor=torch.exp(new - old))


def _sync(device: str) -> None:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()


def _ours(args: argparse.Namespace, model_dir: Path, adapters: list[str], order: str, rank: int = 8):
    from teamrl.learner.engine import AdapterSettings, LearnerEngine

    return LearnerEngine.build(
        model_dir,
        adapters,
        adapter_settings={a: AdapterSettings(lr=1e-4, clip_low=0.2, clip_high=0.2) for a in adapters},
        lora_rank=rank,
        lora_alpha=2.0 * rank,
        dtype=args.dtype,
        device=args.device,
        micro_batch_rows=args.rows,
        micro_batch_tokens=args.rows * (args.prompt + args.response),  # one micro-batch, as the bare loop
        logprob_tolerance=None,
        update_order=order,
        zero_stage=args.zero_stage,
    )


def _paired(args: argparse.Namespace, label: str, tokens: int, run_bare, run_ours) -> float:
    """Warm up both sides, time ``args.rounds`` adjacent (bare, ours) pairs, print, return the ratio."""
    wall: dict[str, list[float]] = {"ours": [], "bare": []}
    cpu: dict[str, list[float]] = {"ours": [], "bare": []}
    for fn in (run_bare, run_ours):
        for w in range(args.warmup):
            fn(w)
    _sync(args.device)
    for i in range(args.rounds):
        for name, fn in (("bare", run_bare), ("ours", run_ours)):
            _sync(args.device)
            t, c = time.perf_counter(), time.process_time()
            fn(args.warmup + i)
            _sync(args.device)
            wall[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    print(label)
    for side, name in (("bare PyTorch+PEFT", "bare"), ("ours train_step  ", "ours")):
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{side}: {tokens / w:10.0f} tokens/s wall (median step {w * 1e3:7.1f} ms), "
            f"{tokens / c:10.0f} tokens per CPU-second ({c * 1e3:7.1f} ms)"
        )
    # On CPU the ratio uses process CPU time: on a machine shared with other work, wall time measures
    # the neighbours as much as the code. Either way each round's two adjacent measurements are paired,
    # so slowly drifting load cancels, and the median of the per-round ratios is taken.
    clock = cpu if args.clock == "cpu" else wall
    ratio = statistics.median(b / o for b, o in zip(clock["bare"], clock["ours"], strict=True))
    print(f"ratio by {args.clock} time: {ratio:.3f}")
    return ratio


def bench_update(args: argparse.Namespace, model_dir: Path) -> tuple[float, object, int]:
    from teamrl.protocol.codec import decode_batches, encode_trajectories_buffer

    ours = _ours(args, model_dir, [ADAPTER], "simultaneous")
    bare = Bare(model_dir, ours.device, args.dtype, 1e-4, seed=0)
    vocab = int(ours.model.config.vocab_size)
    trajs = _trajectories(args.rows, args.prompt, args.response, vocab)
    prepared = bare.prepare(trajs)
    frame = encode_trajectories_buffer(trajs)

    def run_ours(step: int) -> None:  # as the service runs it: the reply frame decoded, then the step
        ours.train_step(decode_batches(frame), step, 0)

    def run_bare(step: int) -> None:
        bare.step(prepared)

    tokens = args.rows * (args.prompt + args.response)
    label = f"update batch: {args.rows} rows x ({args.prompt} prompt + {args.response} response) = {tokens} tokens"
    ratio = _paired(args, label, tokens, run_bare, run_ours)
    if args.profile:
        _profile(args, {"bare": run_bare, "ours": run_ours})
    return ratio, ours, vocab


def bench_team(args: argparse.Namespace, model_dir: Path) -> float:
    """Two adapters, sequential update with the HAPPO factor, against the same update by hand."""
    from teamrl.protocol.codec import decode_batches, encode_trajectories_buffer

    pair = (ADAPTER, "verifier-lora")
    ours = _ours(args, model_dir, list(pair), "sequential")
    bare = Bare(model_dir, ours.device, args.dtype, 1e-4, seed=0, adapters=pair)
    vocab = int(ours.model.config.vocab_size)
    trajs = _trajectories(args.rows, args.prompt, args.response, vocab, adapters=pair)
    first, second = bare.prepare(trajs, 0), bare.prepare(trajs, 1)
    frame = encode_trajectories_buffer(trajs)
    tokens = args.rows * (args.prompt + args.response)
    label = (
        f"two adapters, sequential (HAPPO factor): {args.rows // 2} episodes x 2 agents x "
        f"({args.prompt} + {args.response}) = {tokens} tokens; bare = the first adapter's step and "
        "a no-grad pass after it, then the second's step with the factor"
    )
    ratio = _paired(
        args,
        label,
        tokens,
        lambda step: bare.happo(first, second, pair),
        lambda step: ours.train_step(decode_batches(frame), step, 0),
    )
    return ratio


def _profile(args: argparse.Namespace, fns: dict) -> None:
    """torch.profiler over ``--profile`` steps of each side: launches, syncs, copies, top CPU ops."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    n = args.profile
    for name, fn in fns.items():
        _sync(args.device)
        with profile(activities=acts) as prof:
            for i in range(args.profile):
                fn(100 + i)
            _sync(args.device)
        ev = prof.key_averages()

        def count(key: str, ev=ev) -> float:
            return sum(e.count for e in ev if e.key == key) / n

        def device_ms(ev=ev) -> float:
            return sum(getattr(e, "self_device_time_total", 0.0) for e in ev) / n / 1e3

        sync_ms = sum(
            e.self_cpu_time_total
            for e in ev
            if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")
        )
        print(
            f"profile {name}: per step {sync_ms / n / 1e3:.1f} ms host waits in syncs/copies, "
            f"{count('cudaLaunchKernel'):.0f} kernel launches, "
            f"{count('cudaMemcpyAsync'):.0f} memcpy, {count('cudaStreamSynchronize'):.0f} stream syncs, "
            f"{count('aten::item'):.0f} item(), {count('aten::isfinite'):.0f} isfinite, "
            f"{count('aten::copy_'):.0f} copy_, device busy {device_ms():.1f} ms"
        )
        top = sorted((e for e in ev if e.key.startswith("aten::")), key=lambda e: -e.self_cpu_time_total)
        print(
            "  top CPU ops: "
            + ", ".join(
                f"{e.key[6:]} {e.self_cpu_time_total / n / 1e3:.1f} ms x{e.count / n:.0f}" for e in top[:8]
            )
        )


def bench_push(ours, model_dir: Path, args: argparse.Namespace, vocab: int) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from teamrl.protocol.adapters import adapter_dirs, adapters_sha256

    tdtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    recv_base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=tdtype).to(ours.device)
    receiver = None
    prompt = [1 + (i % (vocab - 2)) for i in range(8)]
    completion = [2 + (i % (vocab - 2)) for i in range(4)]
    tmp = Path(tempfile.mkdtemp(prefix="teamrl-push-"))
    parts: dict[str, list[float]] = {k: [] for k in ("export", "sha", "check", "load", "total")}
    size = 0
    errs: list[float] = []
    for v in range(1, args.pushes + 1):
        ours.train_step(_trajectories(args.rows, args.prompt, args.response, vocab, seed=v), 10_000 + v, v)
        want = ours.completion_logprobs(ADAPTER, prompt, completion)
        _sync(args.device)
        t0 = time.perf_counter()
        exported = ours.export_adapters(tmp / f"v{v}")
        t1 = time.perf_counter()
        sha = adapters_sha256(exported)  # what the announcement carries
        t2 = time.perf_counter()
        got = adapter_dirs(tmp / f"v{v}")  # the receiver: checked listing, digest, load in place
        if adapters_sha256(got) != sha:
            raise RuntimeError("sha256 mismatch")
        t3 = time.perf_counter()
        name = f"{ADAPTER}@v{v}"
        if receiver is None:
            receiver = PeftModel.from_pretrained(recv_base, str(got[ADAPTER]), adapter_name=name)
        else:
            receiver.load_adapter(str(got[ADAPTER]), adapter_name=name)
            receiver.set_adapter(name)
            receiver.delete_adapter(f"{ADAPTER}@v{v - 1}")
        receiver.eval()
        _sync(args.device)
        t4 = time.perf_counter()
        size = sum(f.stat().st_size for f in got[ADAPTER].iterdir() if f.name.startswith("adapter_"))
        with torch.no_grad():
            ids = torch.tensor([prompt + completion], device=ours.device)
            logp = torch.log_softmax(receiver(input_ids=ids).logits[0].float(), -1)
        live = [float(logp[len(prompt) - 1 + j, t]) for j, t in enumerate(completion)]
        err = max(abs(a - b) for a, b in zip(live, want, strict=True))
        errs.append(err)
        if err > push_atol(args.dtype):
            raise RuntimeError(
                f"pushed adapter v{v} does not reproduce the learner's probe within "
                f"{push_atol(args.dtype):.1e} ({args.dtype}): {live} vs {want}"
            )
        for k, d in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0), strict=True):
            parts[k].append(d * 1e3)
    med = {k: statistics.median(x) for k, x in parts.items()}
    rank = ours.model.peft_config[ADAPTER].r
    print(
        f"weight push, LoRA r {rank} ({size / 1024:.0f} KiB adapter, median of {args.pushes}): total "
        f"{med['total']:.1f} ms = export {med['export']:.1f} + sha256 {med['sha']:.1f} + "
        f"check in place {med['check']:.1f} + PEFT load {med['load']:.1f} ms (receiver's probe "
        f"log-probs match: max |diff| {max(errs):.1e} <= {push_atol(args.dtype):.1e}, {args.dtype})"
    )
    print("vLLM hot-load latency of a pushed adapter is measured by tests/bench/rollout.py, not here")


def bench_memory(args: argparse.Namespace, model_dir: Path) -> None:
    """Peak RSS of one ``train_step`` at the learner's default micro-batch settings (rows and token
    budget) on ``args.memory`` = ROWSxTOKENS rows, above the RSS of the built engine; the log-probs are
    computed in chunks (teamrl.learner.logprobs), so full-vocabulary logits never exist at once."""
    import resource

    from teamrl.learner.engine import AdapterSettings, LearnerEngine
    from teamrl.learner.settings import OptimSettings
    from teamrl.protocol.codec import decode_batches, encode_trajectories_buffer

    rows, tokens = (int(x) for x in args.memory.lower().split("x"))
    ours = LearnerEngine.build(
        model_dir,
        [ADAPTER],
        adapter_settings={ADAPTER: AdapterSettings(lr=1e-4, clip_low=0.2, clip_high=0.2)},
        dtype=args.dtype,
        device=args.device,
        logprob_tolerance=None,
    )
    vocab = int(ours.model.config.vocab_size)
    frame = encode_trajectories_buffer(_trajectories(rows, tokens // 2, tokens - tokens // 2, vocab))

    def rss_mib() -> float:
        return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20

    before = rss_mib()
    t0 = time.perf_counter()
    ours.train_step(decode_batches(frame), 0, 0)
    took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    d = OptimSettings()
    print(
        f"memory: one train_step of {rows} rows x {tokens} tokens ({args.dtype}, defaults micro_batch_rows "
        f"{d.micro_batch_rows}, micro_batch_tokens {d.micro_batch_tokens}): peak RSS {peak:.0f} MiB "
        f"(engine built: {before:.0f} MiB), {rows * tokens / took:.0f} tokens/s"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer rounds (under 60 s on 2 CPU cores)")
    p.add_argument(
        "--model", default="", help="model folder or name, e.g. smollm2-135m (default: the embedded model)"
    )
    p.add_argument(
        "--memory",
        default="",
        metavar="ROWSxTOKENS",
        help="instead: peak memory of one default-settings train_step on ROWS rows of TOKENS tokens "
        "(half prompt, half response), e.g. 64x800, in a fresh process",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument(
        "--random-init-qwen05b",
        action="store_true",
        help="build a random-initialised Qwen2.5-0.5B-shaped model in a temp folder (for GPU machines)",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="")
    p.add_argument("--rows", type=int, default=0, help="agent steps per update (default by model)")
    p.add_argument("--prompt", type=int, default=0)
    p.add_argument("--response", type=int, default=0)
    p.add_argument("--rounds", type=int, default=0)
    p.add_argument("--pushes", type=int, default=0)
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=2, help="ours' ZeRO stage")
    p.add_argument("--profile", type=int, default=0, help="torch-profile this many steps of each side")
    p.add_argument(
        "--team",
        action="store_true",
        help="also time a two-adapter sequential step (HAPPO factor) against the same update by hand",
    )
    p.add_argument(
        "--push-rank", type=int, default=0, help="LoRA rank of the pushed adapter (default: the update's, 8)"
    )
    p.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="",
        help="time the ratio is computed from (default: cpu on --device cpu, wall on cuda)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: steadiest figures on a shared machine)"
    )
    args = p.parse_args()
    big = args.random_init_qwen05b or bool(args.model)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    args.rows = args.rows or (16 if big else 64)
    args.prompt = args.prompt or (256 if big else 24)
    args.response = args.response or (256 if big else 24)
    args.rounds = args.rounds or (5 if args.quick else 15)
    args.warmup = 2
    args.clock = args.clock or ("cpu" if args.device == "cpu" else "wall")
    args.pushes = args.pushes or (3 if args.quick else 8)

    import torch

    from teamrl.learner.engine import init_distributed

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    init_distributed(args.device)
    if args.random_init_qwen05b:
        model_dir = _qwen05b_shaped(Path(tempfile.mkdtemp(prefix="qwen05b-")), args.dtype)
        print(f"model: random-initialised Qwen2.5-0.5B-shaped ({model_dir}), {args.dtype}, {args.device}")
    elif args.model:
        from teamrl.cli.plan import resolve_model

        model_dir = resolve_model(args.model)
        print(f"model: {model_dir}, {args.dtype}, {args.device}")
        if args.memory:
            return bench_memory(args, model_dir)
    else:
        from teamrl.learner.modelbuild import build

        model_dir = build()
        print(f"model: embedded ({model_dir}), {args.dtype}, {args.device}")
    ratio, ours, vocab = bench_update(args, model_dir)
    team_ratio = bench_team(args, model_dir) if args.team else None
    if args.push_rank and args.push_rank != 8:
        del ours
        ours = _ours(args, model_dir, [ADAPTER], "simultaneous", rank=args.push_rank)
    bench_push(ours, model_dir, args, vocab)
    if team_ratio is not None:
        print(f"team_ratio={team_ratio:.3f}")
    print(f"learner_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
