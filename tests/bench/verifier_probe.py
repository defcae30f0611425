"""Why the addition verifier does not learn: what the embedded model's verifier can tell apart, and
whether the model can learn to tell right from wrong answers at all, by supervised training.

    python tests/bench/verifier_probe.py [--steps 1000] [--formats plain,recompute,compare,compare-adjacent,check]

1. **Signal in the base.** The embedded model (``teamrl model build``) samples one answer per held-out
   task at temperature 1 (the distribution the verifier is trained on during RL); its verifier scores
   each (prompt ``V07+45=052?``) by logit("1") - logit("0"). Printed: the share of right answers, the
   AUC of that score over right against wrong answers (0.5: no signal), and the greedy verdict's
   balanced accuracy (mean of accept rate on right answers and reject rate on wrong ones).
2. **Learnability.** For each format, a copy of the model is trained supervised (AdamW, batch 128,
   lr ``--lr``), the verdict token's cross-entropy printed every ``--every`` steps (ln 2 = 0.693 is
   chance) with, at the end, the held-out verdict balanced accuracy on the base model's own answers:
   * ``plain``: ``V07+45=052?`` -> ``1;`` / ``0;``, half the batch solver examples (the build's mix);
   * ``recompute``: the verifier writes the sum, then the verdict (``V07+45=052?`` -> ``0521;``);
   * ``compare``: the comparison alone, two 3-digit numbers (``V052=058?`` -> ``0;``);
   * ``compare-adjacent``: the same comparison with the two numbers' digits interleaved pairwise
     (``V005528?``), so each pair to compare sits side by side;
   * ``check``: a worked check, every step a token: the candidate first, then the question
     (``V058?07+45=``), and the verifier writes the sum, a mark per digit (``=`` agrees, ``R``
     differs) and the verdict (``052==R0;``); evaluated on the *trained* model's own held-out answers
     (temperature 1), so it also runs from scratch.
   Wrong answers are the build's near misses (off by 1, 10 or up to 30), half the verifier examples.
3. **From scratch** (``--init scratch``): the same learnability runs on a randomly initialised model of
   the built model's shape (``--layers``, ``--kv-heads`` change it), warmed up over 50 steps; only the
   ``compare`` formats and ``check`` mean anything there (the base cannot add), e.g.
   ``--init scratch --formats compare,compare-adjacent --steps 3000 --lr 3e-3`` or
   ``--init scratch --formats check --steps 800 --lr 1e-3`` (docs/verifier-learning.md). The
   shipped checker is that recipe as a model build (``teamrl model build --kind checker``: the same
   format, prompts with BOS first as rollouts encode them).

Prints figures, asserts none (docs/verifier-learning.md quotes a run of it). About 2 minutes per
1,000 steps per format on one core.
"""

from __future__ import annotations

import argparse
import copy
import random
import time

LN2 = 0.6931


def _auc(pos: list[float], neg: list[float]) -> float:
    if not pos or not neg:
        return float("nan")
    return sum((p > n) + 0.5 * (p == n) for p in pos for n in neg) / (len(pos) * len(neg))


def _near_miss(rng: random.Random, s: int) -> tuple[int, bool]:
    from teamrl.rewards.addition import near_miss

    right = rng.random() < 0.5
    return (s if right else near_miss(rng, s)), right


class Probe:
    def __init__(self, model_dir: str, seed: int, scratch: dict[str, int] | None = None) -> None:
        import torch
        from transformers import AutoConfig, PreTrainedTokenizerFast, Qwen2ForCausalLM

        from teamrl.rewards import addition

        self.torch, self.A = torch, addition
        self.tok = PreTrainedTokenizerFast.from_pretrained(model_dir)
        self.warmup = 50 if scratch is not None else 0
        if scratch is None:
            self.base = Qwen2ForCausalLM.from_pretrained(model_dir).eval()
        else:  # the built model's shape, random weights (seeded)
            cfg = AutoConfig.from_pretrained(model_dir)
            cfg.num_hidden_layers = scratch.get("layers") or cfg.num_hidden_layers
            cfg.num_key_value_heads = scratch.get("kv_heads") or cfg.num_key_value_heads
            torch.manual_seed(seed)
            self.base = Qwen2ForCausalLM(cfg).eval()
        self.train, self.held = addition.split_tasks(0)
        self.one = self.tok.convert_tokens_to_ids("1")
        self.zero = self.tok.convert_tokens_to_ids("0")
        torch.manual_seed(seed)
        outs = self._generate(self.base, [addition.solver_prompt(t) for t in self.held], 4, 1.0)
        self.cands = [addition.parse_answer(o)[:3].rjust(3, "0") for o in outs]
        self.right = [c == t["answer"] for t, c in zip(self.held, self.cands, strict=True)]

    def _generate(self, model, prompts: list[str], n: int, temperature: float) -> list[str]:
        torch = self.torch
        ids = torch.tensor([self.tok.encode(p) for p in prompts])  # one role's prompts share a length
        with torch.no_grad():
            for _ in range(n):
                logits = model(input_ids=ids).logits[:, -1]
                if temperature > 0:
                    nxt = torch.multinomial((logits / temperature).softmax(-1), 1)
                else:
                    nxt = logits.argmax(-1, keepdim=True)
                ids = torch.cat([ids, nxt], 1)
        width = len(self.tok.encode(prompts[0]))
        return [self.tok.decode(row[width:].tolist()) for row in ids]

    def base_signal(self) -> dict[str, float]:
        prompts = [self.A.verifier_prompt(t, c) for t, c in zip(self.held, self.cands, strict=True)]
        with self.torch.no_grad():
            logits = self.base(input_ids=self.torch.tensor([self.tok.encode(p) for p in prompts])).logits[
                :, -1
            ]
        score = (logits[:, self.one] - logits[:, self.zero]).tolist()
        pos = [x for x, r in zip(score, self.right, strict=True) if r]
        neg = [x for x, r in zip(score, self.right, strict=True) if not r]
        tpr = sum(x > 0 for x in pos) / max(1, len(pos))
        tnr = sum(x <= 0 for x in neg) / max(1, len(neg))
        return {"right_share": len(pos) / len(score), "auc": _auc(pos, neg), "balanced": (tpr + tnr) / 2}

    def example(self, fmt: str, rng: random.Random) -> tuple[str, str]:
        A = self.A
        t = rng.choice(self.train)
        if fmt in ("plain", "recompute", "check") and rng.random() < 0.5:
            return A.solver_prompt(t), t["answer"] + A.EOS
        s = int(t["answer"])
        cand, right = _near_miss(rng, s)
        verdict = "1" if right else "0"
        if fmt == "plain":
            return A.verifier_prompt(t, f"{cand:03d}"), verdict + A.EOS
        if fmt == "recompute":
            return A.verifier_prompt(t, f"{cand:03d}"), t["answer"] + verdict + A.EOS
        if fmt == "compare":
            return f"V{s:03d}={cand:03d}?", verdict + A.EOS
        if fmt == "check":  # the checker's format (teamrl model build --kind checker)
            return A.check_prompt(t, f"{cand:03d}"), A.check_response(t, f"{cand:03d}")
        pairs = "".join(x + y for x, y in zip(f"{s:03d}", f"{cand:03d}", strict=True))
        return f"V{pairs}?", verdict + A.EOS

    def learn(self, fmt: str, steps: int, lr: float, every: int, seed: int, save: str = "") -> None:
        from teamrl.learner.modelbuild import _pack

        torch = self.torch
        model = copy.deepcopy(self.base).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        warm = self.warmup
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        rng = random.Random(seed)
        t0 = time.time()
        window: list[float] = []
        for step in range(1, steps + 1):
            batch = [self.example(fmt, rng) for _ in range(128)]
            ids, labels = _pack(self.tok, batch)
            out = model(input_ids=ids, labels=labels)
            opt.zero_grad()
            out.loss.backward()
            opt.step()
            sched.step()
            window.append(self._verdict_loss(out.logits.detach(), ids, batch))
            if step % every == 0 or step == steps:
                print(
                    f"  {fmt} step {step}: verdict loss {sum(window) / len(window):.3f} "
                    f"(chance {LN2:.3f}) ({time.time() - t0:.0f} s)",
                    flush=True,
                )
                window = []
        if fmt.startswith("compare"):  # 400 held-out comparisons (their own seed): greedy verdict accuracy
            model.eval()
            erng = random.Random(99)
            tests = [self.example(fmt, erng) for _ in range(400)]
            with torch.no_grad():
                ids = torch.tensor([self.tok.encode(p) for p, _ in tests])
                said = model(input_ids=ids).logits[:, -1].argmax(-1).tolist()
            acc = sum(
                s == self.tok.convert_tokens_to_ids(r[0]) for s, (_, r) in zip(said, tests, strict=True)
            )
            print(f"  {fmt}: held-out comparison accuracy {acc / len(tests):.3f}", flush=True)
        if fmt == "check":
            self._own_answers_checked(model.eval())
        if fmt in ("plain", "recompute"):
            model.eval()
            n = 5 if fmt == "recompute" else 2
            prompts = [self.A.verifier_prompt(t, c) for t, c in zip(self.held, self.cands, strict=True)]
            said = [o.split(self.A.EOS)[0][-1:] == "1" for o in self._generate(model, prompts, n, 0.0)]
            good = [s for s, r in zip(said, self.right, strict=True) if r]
            bad = [not s for s, r in zip(said, self.right, strict=True) if not r]
            rates = [sum(x) / len(x) for x in (good, bad) if x]
            print(f"  {fmt}: held-out verdict balanced accuracy {sum(rates) / len(rates):.3f}", flush=True)
        if save:  # the trained model, loadable by vLLM and transformers (tokenizer from the model folder)
            model.save_pretrained(save, safe_serialization=True)
            self.tok.save_pretrained(save)
            print(f"  {fmt}: saved to {save}", flush=True)

    def _own_answers_checked(self, model) -> None:
        """The trained model answers the held-out tasks twice at temperature 1; its verifier checks
        each answer (greedy); verdict = the character before the first ``;``."""
        A = self.A
        tasks = self.held * 2
        greedy = self._generate(model, [A.solver_prompt(t) for t in self.held], 4, 0.0)
        solver = sum(A.solver_reward(t, o) for t, o in zip(self.held, greedy, strict=True)) / len(self.held)
        outs = self._generate(model, [A.solver_prompt(t) for t in tasks], 4, 1.0)
        cands = [A.parse_answer(o)[:3].rjust(3, "0") for o in outs]
        right = [c == t["answer"] for t, c in zip(tasks, cands, strict=True)]
        checks = self._generate(
            model, [A.check_prompt(t, c) for t, c in zip(tasks, cands, strict=True)], 9, 0.0
        )
        said = [o.split(A.EOS)[0][-1:] == "1" for o in checks]
        tpr = sum(s for s, r in zip(said, right, strict=True) if r) / max(1, sum(right))
        tnr = sum(not s for s, r in zip(said, right, strict=True) if not r) / max(1, len(right) - sum(right))
        rng = random.Random(99)  # and on near misses of the held-out sums, half right
        near = [_near_miss(rng, int(t["answer"])) for t in self.held]
        checks = self._generate(
            model, [A.check_prompt(t, f"{c:03d}") for t, (c, _) in zip(self.held, near, strict=True)], 9, 0.0
        )
        said_near = [o.split(A.EOS)[0][-1:] == "1" for o in checks]
        rates = [
            sum(s == r for s, (_, r) in zip(said_near, near, strict=True) if r == want)
            / max(1, sum(r == want for _, r in near))
            for want in (True, False)
        ]
        print(
            f"  check: on near misses of the held-out sums: balanced accuracy {sum(rates) / 2:.3f}",
            flush=True,
        )
        print(
            f"  check: solver greedy accuracy {solver:.3f}; on its own answers at T=1 ({sum(right) / len(right):.2f} "
            f"right): accept rate on right {tpr:.3f}, reject rate on wrong {tnr:.3f}, "
            f"held-out verdict balanced accuracy {(tpr + tnr) / 2:.3f}",
            flush=True,
        )

    def _verdict_loss(self, logits, ids, batch: list[tuple[str, str]]) -> float:
        """Mean cross-entropy of the verdict token (the one before ``;``) over the batch's verifier rows."""
        logp = logits.log_softmax(-1)
        losses = []
        for i, (prompt, response) in enumerate(batch):
            if not prompt.startswith("V"):
                continue
            at = len(self.tok.encode(prompt)) + len(self.tok.encode(response)) - 2  # verdict position
            losses.append(-float(logp[i, at - 1, int(ids[i, at])]))
        return sum(losses) / max(1, len(losses))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="model folder (default: the embedded model, built if missing)")
    p.add_argument("--steps", type=int, default=1000, help="supervised steps per format")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--every", type=int, default=200, help="print the verdict loss every this many steps")
    p.add_argument("--formats", default="plain,recompute,compare,compare-adjacent,check")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--init",
        choices=["built", "scratch"],
        default="built",
        help="start from the built model or random weights",
    )
    p.add_argument(
        "--layers", type=int, default=0, help="with --init scratch: layers (default: the built model's)"
    )
    p.add_argument(
        "--kv-heads", type=int, default=0, help="with --init scratch: KV heads (default: the built model's)"
    )
    p.add_argument(
        "--save",
        default="",
        help="write the model trained on the last format to this folder (a model folder)",
    )
    args = p.parse_args(argv)
    formats = [f for f in args.formats.split(",") if f]
    unknown = set(formats) - {"plain", "recompute", "compare", "compare-adjacent", "check"}
    if unknown:
        p.error(f"unknown format(s): {', '.join(sorted(unknown))}")

    import torch

    from teamrl.learner.modelbuild import build

    torch.set_num_threads(args.threads)
    scratch = {"layers": args.layers, "kv_heads": args.kv_heads} if args.init == "scratch" else None
    probe = Probe(args.model or str(build()), args.seed, scratch)
    sig = probe.base_signal()
    print(
        f"base verifier on the base solver's own held-out answers (T=1): {sig['right_share']:.2f} right, "
        f"AUC {sig['auc']:.3f}, greedy balanced accuracy {sig['balanced']:.3f}",
        flush=True,
    )
    for fmt in formats:
        probe.learn(fmt, args.steps, args.lr, args.every, args.seed, args.save if fmt == formats[-1] else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
