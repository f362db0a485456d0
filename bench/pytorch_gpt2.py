#!/usr/bin/python3
"""PyTorch's side of bench:train's CPU rows, and of its GPT-2 124M GPU row (docs/PERFORMANCE.md).

The same GPT-2 shapes as //bench:train (GPT-2 tiny: 4 layers, hidden 256,
4 heads, vocab 256, seq 128, batch 8; GPT-2 small: 12 layers, hidden 768,
12 heads, vocab 50257, seq 128, batch 4), written out in torch (pre-norm
blocks, fused qkv, causal attention, tanh GELU, tied head), trained in f32
with AdamW and gradient clipping at 1.0 on random tokens, at each thread
count on that many cores: a process per count, confined to its cores, with
torch.set_num_threads and OpenBLAS's and OpenMP's pools all set to it
(set_num_threads alone leaves Debian's OpenBLAS a thread per core). tokens/s
is batch * seq over the mean step time after 2 warm-up steps, as
bench:train counts it.

--device cuda runs GPT-2 124M as bench:train's GPU row does (seq 1024,
batch 8, bf16 autocast with f32 master weights, AdamW, clipping at 1.0) on
cuda:0, one row per recipe (--rows, default sdpa,tuned,compile):

  manual   colod's math: the attention written out as above, the vocabulary
           at GPT-2's 50257, torch's default (foreach) AdamW;
  sdpa     the same with F.scaled_dot_product_attention (flash attention);
  tuned    the usual strongest GPT-2 recipe in eager mode (nanoGPT's, llm.c's
           PyTorch reference): SDPA, the vocabulary padded to 50304 (a
           multiple of 64), fused AdamW, TF32 allowed for f32 matmuls;
  compile  tuned, under torch.compile.

Each row is the median step of --repeats (default 3) windows of --steps
timed steps after warm-up (torch.compile's compilation is in the warm-up).

Run with Debian's python3-torch where present (it is not a dependency of
colod's build or tests):

    /usr/bin/python3 bench/pytorch_gpt2.py [--model gpt2-tiny|gpt2-small] [--steps N] [--threads 1,2]
    python3 bench/pytorch_gpt2.py --device cuda [--model gpt2-124m] [--rows manual,sdpa,tuned,compile]
"""
import argparse
import contextlib
import math
import os
import subprocess
import sys
import time

# Each thread count runs in a process of its own (main() below), confined to
# that many cores, with OpenBLAS's and OpenMP's pools sized before torch loads
# them: torch.set_num_threads does not bind Debian's OpenBLAS, whose own
# threads would otherwise use every core whatever the count says.
if os.environ.get("COLOD_BENCH_THREADS"):
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: int(os.environ["COLOD_BENCH_THREADS"])])

import torch
import torch.nn as nn
import torch.nn.functional as F

SHAPES = {
    # name: (vocab, hidden, layers, heads, seq, batch, steps)
    "gpt2-tiny": (256, 256, 4, 4, 128, 8, 10),
    "gpt2-small": (50257, 768, 12, 12, 128, 4, 2),
    "gpt2-124m": (50257, 768, 12, 12, 1024, 8, 10),  # bench:train's GPU row
}
ATTENTION = "manual"
CUDA_ROWS = ("manual", "sdpa", "tuned", "compile")


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(h, eps=1e-5)
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h, eps=1e-5)
        self.c_fc = nn.Linear(h, 4 * h)
        self.mlp_proj = nn.Linear(4 * h, h)

    def forward(self, x, mask):
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, d).transpose(1, 2) for t in (q, k, v))
        if ATTENTION == "sdpa":
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(d)
            scores = scores.masked_fill(mask, float("-inf"))
            a = F.softmax(scores, dim=-1) @ v
        a = a.transpose(1, 2).reshape(b, s, h)
        x = x + self.c_proj(a)
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class Gpt2(nn.Module):
    def __init__(self, vocab, h, layers, heads, positions):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(positions, h)
        self.blocks = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h, eps=1e-5)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, ids):
        s = ids.shape[1]
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=ids.device), diagonal=1)
        x = self.wte(ids) + self.wpe(torch.arange(s, device=ids.device))
        for blk in self.blocks:
            x = blk(x, mask)
        return self.ln_f(x) @ self.wte.weight.t()  # the tied head


def run(name, threads, steps, warmup=2, device="cpu", recipe=None, repeats=1):
    """Trains `name`; returns (median step seconds, tokens/s) over `repeats` windows of `steps` steps."""
    global ATTENTION
    vocab, h, layers, heads, seq, batch, default_steps = SHAPES[name]
    steps = steps or default_steps
    torch.set_num_threads(threads)
    torch.manual_seed(1)
    tuned = recipe in ("tuned", "compile")
    if recipe is not None:
        ATTENTION = "manual" if recipe == "manual" else "sdpa"
    torch.backends.cuda.matmul.allow_tf32 = tuned
    torch.backends.cudnn.allow_tf32 = tuned
    table = (vocab + 63) // 64 * 64 if tuned else vocab  # 50304 for GPT-2: tensor-core friendly
    model = Gpt2(table, h, layers, heads, max(seq, 64)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, **({"fused": True} if tuned else {}))
    if tuned:
        # nanoGPT's: the loss inside autocast (cross_entropy runs in f32 there
        # without an f32 copy of the logits), and under torch.compile with the model.
        def forward_loss(x, y):
            return F.cross_entropy(model(x).reshape(-1, table), y.reshape(-1))
    else:
        def forward_loss(x, y):
            return F.cross_entropy(model(x).float().reshape(-1, table), y.reshape(-1))
    if recipe == "compile":
        forward_loss = torch.compile(forward_loss)
    ids = torch.randint(0, vocab, (warmup + steps * repeats, batch, seq + 1), device=device)
    ends = []
    for i in range(warmup + steps * repeats):
        x, y = ids[i, :, :-1], ids[i, :, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else contextlib.nullcontext():
            loss = forward_loss(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        float(loss.detach())
        ends.append(time.perf_counter())
    windows = sorted((ends[warmup - 1 + (r + 1) * steps] - ends[warmup - 1 + r * steps]) / steps
                     for r in range(repeats))
    step = windows[len(windows) // 2]
    return step, batch * seq / step


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-tiny", choices=sorted(SHAPES))
    ap.add_argument("--steps", type=int, default=0, help="timed steps (default: bench:train's, 10 or 2)")
    ap.add_argument("--threads", default="1,2", help="thread counts to run, comma-separated")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                    help="cuda: one run on cuda:0 in bf16 autocast (default model gpt2-124m)")
    ap.add_argument("--attention", default="manual", choices=["manual", "sdpa"],
                    help="CPU rows: written-out attention (colod's math) or F.scaled_dot_product_attention")
    ap.add_argument("--rows", default="sdpa,tuned,compile",
                    help="--device cuda: recipes to run, comma-separated, of " + ",".join(CUDA_ROWS))
    ap.add_argument("--repeats", type=int, default=3, help="--device cuda: timed windows per row (median)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    global ATTENTION
    ATTENTION = args.attention
    if args.device == "cuda":
        name = args.model if "--model" in sys.argv else "gpt2-124m"
        rows = [r for r in args.rows.split(",") if r]
        bad = [r for r in rows if r not in CUDA_ROWS]
        if bad or not rows:
            ap.error(f"--rows: unknown recipe(s) {','.join(bad)}; choose from {','.join(CUDA_ROWS)}")
        if args.repeats < 1:
            ap.error("--repeats must be at least 1")
        print(f"PyTorch {torch.__version__} on {torch.cuda.get_device_name(0)}, bf16 autocast; "
              f"{name}, median of {args.repeats} windows")
        print(f"{'recipe':<9} {'step (ms)':>10} {'tokens/s':>9}", flush=True)
        for recipe in rows:
            step, tps = run(name, torch.get_num_threads(), args.steps, warmup=5 if recipe == "compile" else 3,
                            device="cuda", recipe=recipe, repeats=args.repeats)
            print(f"{recipe:<9} {step * 1e3:>10.1f} {tps:>9.0f}", flush=True)
            torch.cuda.empty_cache()
        return
    if args.child:  # one thread count, in the process main() made for it
        t = int(os.environ["COLOD_BENCH_THREADS"])
        step, tps = run(args.model, t, args.steps)
        print(f"{args.model:<11} {t:>7} {len(os.sched_getaffinity(0)):>5} {step * 1e3:>10.1f} {tps:>9.0f}", flush=True)
        return
    print(f"PyTorch {torch.__version__}; each row on as many cores as threads (OPENBLAS_NUM_THREADS too)")
    print(f"{'model':<11} {'threads':>7} {'cores':>5} {'step (ms)':>10} {'tokens/s':>9}", flush=True)
    for t in (int(x) for x in args.threads.split(",")):
        env = dict(os.environ, COLOD_BENCH_THREADS=str(t), OPENBLAS_NUM_THREADS=str(t), OMP_NUM_THREADS=str(t))
        subprocess.run([sys.executable, __file__, "--child", "--model", args.model, "--steps", str(args.steps)],
                       env=env, check=True)


if __name__ == "__main__":
    main()
