#!/usr/bin/env python3
"""Train a small GPT with flashattn_ext as its attention, or torch's, and compare.

    python examples/train_gpt.py --attn ours            # tiny model, CPU, well under a minute
    python examples/train_gpt.py --attn torch
    python examples/train_gpt.py --compare --json curves.json   # both, same seed, steps interleaved: loss difference, time ratio
    python examples/train_gpt.py --compare --tol 1e-3           # exit 1 if the first 50 steps disagree
    python examples/train_gpt.py --compare --device cuda          # a GPT-2-small-like model in bf16
    python examples/train_gpt.py --compare --attn-dropout 0.1     # with attention dropout (SDPA's dropout_p)

Swapping the attention is one line. A model written against torch,

    y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

runs on flashattn_ext's kernels with

    y = flashattn_ext.scaled_dot_product_attention(q, k, v, is_causal=True)

same signature, same (batch, heads, seqlen, head_dim) layout, same semantics; here
the choice is `attention_function()` below, read once by every block.

The data is generated in code (nothing is downloaded): lines such as
"hgbad|hgbad", a random word (2 to 6 letters) and its copy. The first half is noise; the copy is
predictable only by attending back to the word, so "copy accuracy" (greedy
next-character accuracy on the copied halves of held-out lines) rises from
chance (~10%) towards 100% only if attention works, forward and backward.
"""

import argparse
import json
import math
import os
import random
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

# An installed flashattn_ext (pip install -e .) or one on PYTHONPATH wins; else the
# checkout this example lives in, built in place.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isdir(os.path.join(_ROOT, "flashattn_ext")):
    sys.path.append(_ROOT)

ALPHABET = "abcdefghij"
VOCAB = ALPHABET + "|\n"
STOI = {c: i for i, c in enumerate(VOCAB)}


def attention_function(name):
    """The attention every block calls, with torch's SDPA signature."""
    if name == "torch":
        return F.scaled_dot_product_attention
    import flashattn_ext

    return flashattn_ext.scaled_dot_product_attention  # <- the one-line swap


def ours_note(cfg, device, dtype):
    """Says whether flashattn_ext's kernels compute this model's attention, or hand it to torch."""
    import flashattn_ext

    why = getattr(flashattn_ext, "sdpa_fallback_reason", None)
    if why is None:
        return "flashattn_ext has no sdpa_fallback_reason(); cannot tell whether its kernels run"
    e = cfg["d_model"] // cfg["n_head"]
    q = torch.empty(1, cfg["n_head"], cfg["seq"], e, device=device, dtype=dtype)
    reason = why(q, q, q, is_causal=True, dropout_p=cfg.get("attn_dropout", 0.0))
    return (
        "flashattn_ext's kernels compute the attention"
        if reason is None
        else f"flashattn_ext hands this attention to torch: {reason}"
    )


# ----------------------------------------------------------------------------- data


WORD_LEN = (2, 6)


def make_corpus(n_chars, seed):
    """Copy lines "word|word\\n"; returns (tokens, is_copy) where is_copy marks the
    characters that are predictable from earlier ones (the copy and its newline)."""
    rng = random.Random(seed)
    toks, copy = [], []
    while len(toks) < n_chars:
        word = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*WORD_LEN)))
        line = word + "|" + word + "\n"
        toks += [STOI[c] for c in line]
        copy += [False] * (len(word) + 1) + [True] * (len(word) + 1)
    return torch.tensor(toks[:n_chars], dtype=torch.long), torch.tensor(copy[:n_chars], dtype=torch.bool)


def get_batch(data, batch, seq, gen):
    ix = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    x = torch.stack([data[i : i + seq] for i in ix.tolist()])
    y = torch.stack([data[i + 1 : i + seq + 1] for i in ix.tolist()])
    return x, y, ix


# ----------------------------------------------------------------------------- model


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, sdpa, dropout_p=0.0):
        super().__init__()
        self.n_head = n_head
        self.dropout_p = dropout_p  # on the attention probabilities, in training only (as GPT-2's)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.sdpa = sdpa

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim): views, no copy (torch's SDPA layout)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = self.sdpa(q, k, v, is_causal=True, dropout_p=self.dropout_p if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d_model, n_head, sdpa, dropout_p=0.0):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head, sdpa, dropout_p)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab, seq, d_model, n_head, n_layer, sdpa, dropout_p=0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, sdpa, dropout_p) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


# ----------------------------------------------------------------------------- training


CONFIGS = {
    # ~0.1M parameters, head_dim 16: about 15 ms a step with torch's attention on two
    # idle cores (10 s a run); copy accuracy passes 50% within these steps.
    "cpu": dict(d_model=64, n_head=4, n_layer=2, seq=64, batch=32, steps=600, lr=3e-3),
    # GPT-2-small-like blocks (d_model 768, 12 heads of 64), 6 layers, 1k context.
    "cuda": dict(d_model=768, n_head=12, n_layer=6, seq=1024, batch=16, steps=300, lr=6e-4),
}


class Run:
    """One training run: a model, its optimizer and its batches, advanced a step at a
    time (so that --compare can interleave the steps of two runs)."""

    def __init__(self, attn, cfg, device, dtype, seed):
        self.attn, self.cfg, self.device = attn, cfg, device
        torch.manual_seed(seed)  # the same initial weights for both attentions
        self.data, _ = make_corpus(max(200_000, cfg["seq"] * 64), seed)
        self.eval_data, self.eval_copy = make_corpus(cfg["seq"] * 64, seed + 1)
        self.model = GPT(
            len(VOCAB),
            cfg["seq"],
            cfg["d_model"],
            cfg["n_head"],
            cfg["n_layer"],
            attention_function(attn),
            cfg.get("attn_dropout", 0.0),
        )
        self.model.to(device)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        self.gen = torch.Generator().manual_seed(seed)  # the same batches for both attentions
        self.autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
        self.losses, self.times = [], []

    def step(self, step):
        cfg, device = self.cfg, self.device
        steps = cfg["steps"]
        # Cosine decay after a short warm-up.
        lr = cfg["lr"] * min(1.0, (step + 1) / 20) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / steps)))
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y, _ = get_batch(self.data, cfg["batch"], cfg["seq"], self.gen)
        x, y = x.to(device), y.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with self.autocast:
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - t0)
        self.losses.append(loss.item())

    def log(self, step):
        print(
            f"  [{self.attn:>5}] step {step:4d}  loss {self.losses[-1]:.4f}  {self.times[-1] * 1e3:7.1f} ms/step",
            flush=True,
        )

    def result(self):
        acc = copy_accuracy(self.model, self.eval_data, self.eval_copy, self.cfg, self.device, self.autocast)
        skip = min(5, max(0, len(self.times) - 1))  # leave out the first steps (allocation, autotuning)
        timed = self.times[skip:]
        return dict(
            losses=self.losses,
            mean_step_ms=1e3 * sum(timed) / max(1, len(timed)),
            median_step_ms=1e3 * statistics.median(timed),
            final_loss=sum(self.losses[-10:]) / len(self.losses[-10:]),
            copy_accuracy=acc,
        )


def train(runs, cfg, log_every):
    """Advances the runs step by step together, taking turns at going first (the
    order alternates every step), so that whatever else loads the machine
    (other processes, the clock, the caches) falls on both alike."""
    steps = cfg["steps"]
    for step in range(steps):
        order = runs if step % 2 == 0 else runs[::-1]
        for run in order:
            run.step(step)
        if step % log_every == 0 or step == steps - 1:
            for run in runs:
                run.log(step)
    return {run.attn: run.result() for run in runs}


@torch.no_grad()
def copy_accuracy(model, data, is_copy, cfg, device, autocast):
    """Greedy next-character accuracy on the characters predictable by copying."""
    model.eval()
    n = (len(data) - 1) // cfg["seq"]
    x = data[: n * cfg["seq"]].view(n, cfg["seq"])[: cfg["batch"]]
    y = data[1 : n * cfg["seq"] + 1].view(n, cfg["seq"])[: cfg["batch"]]
    m = is_copy[1 : n * cfg["seq"] + 1].view(n, cfg["seq"])[: cfg["batch"]].clone()
    m[:, : cfg["seq"] // 4] = False  # the first characters of a window may copy from before it
    with autocast:
        pred = model(x.to(device)).argmax(-1).cpu()
    model.train()
    return ((pred == y) & m).sum().item() / max(1, m.sum().item())


def main(argv=None):
    p = argparse.ArgumentParser(
        description="Train a small GPT on a generated copy task with flashattn_ext's "
        "attention (--attn ours) or torch's (--attn torch), or both (--compare)."
    )
    p.add_argument("--attn", choices=("ours", "torch"), default="ours")
    p.add_argument(
        "--compare",
        action="store_true",
        help="train with both, same seed, their steps interleaved; report the loss difference and the step-time ratio",
    )
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        default=None,
        help="autocast dtype (default fp32 on the CPU, bf16 on CUDA)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--d-model", type=int, default=None)
    p.add_argument("--n-head", type=int, default=None)
    p.add_argument("--n-layer", type=int, default=None)
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument(
        "--attn-dropout",
        type=float,
        default=0.0,
        help="dropout_p of the attention (training steps only); the two attentions then draw different masks",
    )
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--json", metavar="PATH", help="write the loss curves and timings here")
    p.add_argument(
        "--diff-steps",
        type=int,
        default=50,
        help="with --compare: the early steps over which the loss curves must agree (default 50)",
    )
    p.add_argument(
        "--tol",
        type=float,
        default=None,
        help="with --compare: exit 1 when the loss difference over --diff-steps exceeds this",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    device = torch.device(args.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[
        args.dtype or ("bf16" if device.type == "cuda" else "fp32")
    ]
    cfg = dict(CONFIGS[device.type])
    for key in ("steps", "batch", "seq", "d_model", "n_head", "n_layer", "lr"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["attn_dropout"] = args.attn_dropout
    if cfg["d_model"] % cfg["n_head"]:
        raise SystemExit("--d-model must be a multiple of --n-head")

    attns = ["torch", "ours"] if args.compare else [args.attn]
    if "ours" in attns:
        print(f"train_gpt: {ours_note(cfg, device, dtype)}")
    print(
        f"train_gpt: {device.type}, {str(dtype).replace('torch.', '')}, d_model {cfg['d_model']}, "
        f"{cfg['n_head']} heads of {cfg['d_model'] // cfg['n_head']}, {cfg['n_layer']} layers, seq {cfg['seq']}, "
        f"batch {cfg['batch']}, {cfg['steps']} steps, seed {args.seed}, attention dropout {cfg['attn_dropout']:g}"
    )
    runs = train([Run(attn, cfg, device, dtype, args.seed) for attn in attns], cfg, args.log_every)
    for attn in attns:
        r = runs[attn]
        print(
            f"{attn}: final loss {r['final_loss']:.4f}, copy accuracy {r['copy_accuracy']:.1%}, "
            f"median step {r['median_step_ms']:.1f} ms"
        )
    report = dict(config=cfg, device=device.type, dtype=str(dtype).replace("torch.", ""), seed=args.seed, runs=runs)
    rc = 0
    if args.compare:
        # Two runs that differ only in rounding follow the same loss curve for a while,
        # then drift apart (training amplifies tiny differences exponentially): the
        # early steps test the attention, the end of the run tests the statistics.
        a, b = runs["ours"]["losses"], runs["torch"]["losses"]
        diffs = [abs(x - y) for x, y in zip(a, b)]
        k = min(args.diff_steps, len(diffs))
        report["max_loss_diff"] = max(diffs)
        report["max_loss_diff_step"] = diffs.index(max(diffs))
        report["diff_steps"] = k
        report["max_loss_diff_early"] = max(diffs[:k])
        report["first_step_diff_above_1e-3"] = next((i for i, x in enumerate(diffs) if x > 1e-3), None)
        report["final_loss_diff"] = abs(runs["ours"]["final_loss"] - runs["torch"]["final_loss"])
        report["step_time_ratio"] = runs["ours"]["median_step_ms"] / runs["torch"]["median_step_ms"]
        report["steps_interleaved"] = True
        dtype_name = str(dtype).replace("torch.", "")
        if cfg["attn_dropout"] > 0:
            print(
                "compare: with attention dropout the two runs draw different keep masks (each library its own "
                "generator), so their curves differ from the first step by the masks, not by rounding: compare "
                "the final loss and copy accuracy (and --tol does not apply)."
            )
        print(
            f"compare: the two runs start from the same weights and see the same batches; they differ only in "
            f"rounding (the kernels add in different orders). In {dtype_name} such runs follow one loss curve "
            "for tens of steps, then drift apart over hundreds (training amplifies differences of 1e-7 "
            "exponentially), so equal curves to the end are not expected. What is checked instead: the "
            f"agreement over the first {k} steps (--diff-steps; --tol to fail on it), and at the end that both "
            "learn the task alike (final loss and copy accuracy)."
        )
        print(
            f"compare: max |loss(ours) - loss(torch)| over the first {k} steps {report['max_loss_diff_early']:.2e}; "
            f"over all {len(diffs)} steps {report['max_loss_diff']:.2e} (step {report['max_loss_diff_step']}; first "
            f"above 1e-3 at step {report['first_step_diff_above_1e-3']})"
        )
        print(
            f"compare: final loss ours {runs['ours']['final_loss']:.4f} vs torch {runs['torch']['final_loss']:.4f}, "
            f"copy accuracy {runs['ours']['copy_accuracy']:.1%} vs {runs['torch']['copy_accuracy']:.1%}"
        )
        print(
            f"compare: step time ours / torch = {report['step_time_ratio']:.2f} (medians over the steps, the two "
            "runs' steps interleaved and taking turns at going first, so that load on the machine hits both alike)"
        )
        if args.tol is not None and cfg["attn_dropout"] == 0 and report["max_loss_diff_early"] > args.tol:
            print(f"compare: FAIL, loss difference over the first {k} steps above --tol {args.tol:g}")
            rc = 1
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(report, fh, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main())
