"""A real workload beside digits: a character-level transformer LM on the Python standard
library's own ``.py`` sources, 2 ranks with DiLoCo vs one process with the same threads.

    python tools/bench_lm.py                        # 2 x 120 s on this host's cores
    python tools/bench_lm.py --seconds 600 --json lm.jsonl --plot docs/lm_loss.png

Data: every ``.py`` file under ``sysconfig.get_paths()["stdlib"]`` (sorted, up to
``--corpus-mb``), as bytes (vocabulary 256); the last 5% is held out. Every machine with
Python has it, so the run needs no download.

Model: a GPT-style decoder (token + learned position embeddings, ``--layers`` pre-norm
``nn.TransformerEncoderLayer`` blocks with a causal mask, tied output head); the default
is about 6.4 M parameters at context 128.

Variants, each trained for the same wall-clock budget (``--seconds``) with AdamW (lr
``--lr``), batch ``--batch`` sequences per step and rank:

  one process   one replica, ``torch.set_num_threads(threads)``
  DiLoCo        ``--ranks`` rank processes under ``flodl_shm.spawn``, each with
                ``threads / ranks`` threads and its own random windows of the corpus,
                ``flodl_shm.DiLoCo(sync_every=--sync-every)`` (outer Nesterov 0.7 / 0.9)
                after every step

Printed per variant: optimizer steps, tokens trained (all ranks), tokens/s, the last
training loss (mean of the last 20 steps, rank 0) and the held-out loss of the final model
(the consensus, for DiLoCo) on the same ``--eval-batches`` windows. ``--plot`` draws the
training loss against wall time for both.

When it pays: local SGD turns one process's thread-parallel matmuls into rank-parallel
replicas. On a host whose cores one process cannot keep busy (small matmuls, Python
overhead, the backward's serial parts), two replicas with half the threads each train more
tokens per second; whether that buys a lower loss at equal wall time depends on how much
averaged replicas lose to one replica taking every step (measured here, not assumed).
"""
from __future__ import annotations

import importlib
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _bench_common import (out_file, parser, positive_float, positive_int,  # noqa: E402
                           run_main)
from flodl_shm.engine.hostcpu import available_cores  # noqa: E402


def load_corpus(max_mb: float) -> np.ndarray:
    """The stdlib's ``.py`` sources as one uint8 array (sorted files, up to ``max_mb``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    limit = int(max_mb * (1 << 20))
    parts, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        parts.append(data)
        total += len(data)
        if total >= limit:
            break
    if not parts:
        raise RuntimeError(f"no .py files under {root}: this Python has no stdlib sources")
    return np.frombuffer(b"\n".join(parts)[:limit], dtype=np.uint8).copy()


def make_model(d_model: int, layers: int, heads: int, context: int):
    import torch

    class CharLM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(256, d_model)
            self.pos = torch.nn.Parameter(torch.zeros(context, d_model))
            block = torch.nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0,
                                                     activation="gelu", batch_first=True,
                                                     norm_first=True)
            self.blocks = torch.nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
            self.norm = torch.nn.LayerNorm(d_model)
            self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(
                context), persistent=False)

        def forward(self, idx):
            t = idx.shape[1]
            h = self.tok(idx) + self.pos[:t]
            h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
            return self.norm(h) @ self.tok.weight.t()

    torch.manual_seed(0)
    model = CharLM()
    with torch.no_grad():      # GPT-2's scale: the tied head starts near uniform (ln 256)
        torch.nn.init.normal_(model.tok.weight, std=0.02)
        torch.nn.init.normal_(model.pos, std=0.02)
    return model


def _batch(data: np.ndarray, rng: np.random.Generator, batch: int, context: int):
    import torch

    starts = rng.integers(0, len(data) - context - 1, size=batch)
    x = np.stack([data[s:s + context + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(x)
    return t[:, :-1], t[:, 1:]


def _loss(model, x, y):
    import torch

    logits = model(x)
    return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), y.reshape(-1))


def evaluate(model, val: np.ndarray, cfg: dict) -> float:
    import torch

    rng = np.random.default_rng(12345)
    model.eval()
    losses = []
    with torch.no_grad():
        for _ in range(cfg["eval_batches"]):
            x, y = _batch(val, rng, cfg["batch"], cfg["context"])
            losses.append(float(_loss(model, x, y)))
    model.train()
    return statistics.mean(losses)


def _train(model, opt, data: np.ndarray, cfg: dict, seed: int, sgd=None) -> dict:
    """Train until the wall-clock budget is spent; returns the loss curve and counters."""
    rng = np.random.default_rng(seed)
    curve, steps = [], 0
    t0 = time.perf_counter()
    deadline = t0 + cfg["seconds"]
    while True:
        x, y = _batch(data, rng, cfg["batch"], cfg["context"])
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        steps += 1
        curve.append((time.perf_counter() - t0, float(loss.detach())))
        if sgd is not None:
            sgd.step(samples=x.numel())
            if _any_rank_done(sgd.comm, deadline):       # every rank stops after this step
                if sgd.steps_until_sync < sgd.sync_every:
                    sgd.sync()                           # end on a consensus
                break
        elif time.perf_counter() >= deadline:
            break
    return {"steps": steps, "wall_s": time.perf_counter() - t0, "curve": curve}


def _any_rank_done(comm, deadline: float) -> bool:
    """Whether any rank has spent its budget (one small gather after each step, ~0.1 ms
    against a step of tens of ms or more, so every rank stops after the same step)."""
    flags = np.zeros(comm.world_size)
    flags[comm.rank] = 1.0 if time.perf_counter() >= deadline else 0.0
    return bool(comm.all_reduce_per_rank_f64(flags).max() > 0.5)


def _model_and_opt(cfg: dict):
    import torch

    model = make_model(cfg["d_model"], cfg["layers"], cfg["heads"], cfg["context"])
    return model, torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=0.0)


def run_one_process(train: np.ndarray, val: np.ndarray, cfg: dict) -> dict:
    import torch

    torch.set_num_threads(cfg["threads"])
    model, opt = _model_and_opt(cfg)
    res = _train(model, opt, train, cfg, seed=1)
    res["tokens"] = res["steps"] * cfg["batch"] * cfg["context"]
    res["val_loss"] = evaluate(model, val, cfg)
    return res


def _diloco_rank(ctx, train: np.ndarray, val: np.ndarray, cfg: dict) -> dict:
    import torch

    import flodl_shm

    torch.set_num_threads(rank_threads(cfg["threads"], ctx.world_size))
    model, opt = _model_and_opt(cfg)
    sgd = flodl_shm.DiLoCo(model, sync_every=cfg["sync_every"], comm=ctx.comm, optimizer=opt,
                           bf16_wire=cfg["bf16_wire"])
    res = _train(model, opt, train, cfg, seed=100 + ctx.rank, sgd=sgd)
    res["sync_round"] = sgd.sync_round
    res["sync_ms"] = sgd.last_sync.sync_ms if sgd.last_sync else 0.0
    if ctx.rank == 0:
        res["val_loss"] = evaluate(model, val, cfg)
    else:
        res["curve"] = None
    return res


def rank_threads(threads: int, ranks: int) -> int:
    """Each DiLoCo rank's threads: ``threads`` split evenly, at least one."""
    return max(1, threads // ranks)


def threads_note(threads: int, ranks: int) -> str:
    """The header line saying how DiLoCo's ranks split ``threads``, and when they do not
    split evenly (the ranks then have fewer threads in all than the one process, or,
    with more ranks than threads, more: one each)."""
    per = rank_threads(threads, ranks)
    line = f"# DiLoCo: {ranks} ranks × {per} thread{'s' if per > 1 else ''} each"
    if per * ranks == threads:
        return line
    return (f"{line} (--threads {threads} does not split evenly into {ranks} ranks: "
            f"{per * ranks} threads in all, the one process has {threads}"
            f"{'; the ranks share cores' if per * ranks > threads else ''})")


def run_diloco(train: np.ndarray, val: np.ndarray, cfg: dict) -> dict:
    import flodl_shm

    t0 = time.perf_counter()
    out = flodl_shm.spawn(_diloco_rank, cfg["ranks"], args=(train, val, cfg), timeout=600)
    total = time.perf_counter() - t0
    r0 = out[0]
    return {"steps": r0["steps"], "wall_s": max(r["wall_s"] for r in out),
            "tokens": sum(r["steps"] for r in out) * cfg["batch"] * cfg["context"],
            "curve": r0["curve"], "val_loss": r0["val_loss"], "sync_round": r0["sync_round"],
            "launch_s": total}


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--seconds", type=positive_float, default=120.0,
                    help="training budget per variant")
    ap.add_argument("--threads", type=positive_int, default=available_cores(),
                    help="threads of the one process; split evenly among the ranks")
    ap.add_argument("--ranks", type=positive_int, default=2, help="DiLoCo's rank processes")
    ap.add_argument("--d-model", type=positive_int, default=256,
                    help="model width (a multiple of --heads)")
    ap.add_argument("--layers", type=positive_int, default=8, help="transformer blocks")
    ap.add_argument("--heads", type=positive_int, default=8,
                    help="attention heads (must divide --d-model)")
    ap.add_argument("--context", type=positive_int, default=128, help="tokens per sequence")
    ap.add_argument("--batch", type=positive_int, default=16, help="sequences per step and rank")
    ap.add_argument("--lr", type=positive_float, default=1e-3, help="AdamW's learning rate")
    ap.add_argument("--sync-every", type=positive_int, default=32,
                    help="DiLoCo's inner steps per sync")
    ap.add_argument("--bf16-wire", action="store_true", help="DiLoCo syncs over a bf16 wire")
    ap.add_argument("--corpus-mb", type=positive_float, default=8.0,
                    help="MB of stdlib sources to train on")
    ap.add_argument("--eval-batches", type=positive_int, default=20,
                    help="held-out batches of the final evaluation")
    ap.add_argument("--only", choices=["one", "diloco"], help="run one variant only")
    ap.add_argument("--json", type=out_file,
                    help="append one JSON record per variant to this file (JSONL)")
    ap.add_argument("--plot", type=out_file, help="write the loss-vs-wall-time plot (PNG) here")
    args = ap.parse_args(argv)
    if args.d_model % args.heads:
        ap.error(f"--heads {args.heads} does not divide --d-model {args.d_model}; give a "
                 f"head count that divides the width (e.g. --heads 8) or a multiple of "
                 f"{args.heads} as --d-model")
    if args.plot:
        try:
            importlib.import_module("matplotlib")  # fail before training, not after
        except ImportError:
            ap.error("--plot needs matplotlib: pip install -e \".[plot]\"")

    cfg = {k: getattr(args, k) for k in ("seconds", "threads", "ranks", "d_model", "layers",
                                         "heads", "context", "batch", "lr", "sync_every",
                                         "bf16_wire", "eval_batches")}
    data = load_corpus(args.corpus_mb)
    cut = int(len(data) * 0.95)
    train, val = data[:cut], data[cut:]
    n_params = sum(p.numel() for p in make_model(args.d_model, args.layers, args.heads,
                                                 args.context).parameters())
    print(f"# {available_cores()} cores, load average {os.getloadavg()[0]:.2f}; corpus "
          f"{len(data) / 1e6:.1f} MB of stdlib .py; model {n_params / 1e6:.2f} M params, "
          f"context {args.context}, batch {args.batch}; {args.seconds:.0f} s per variant; "
          f"{args.threads} threads", flush=True)
    if args.only != "one":
        print(threads_note(args.threads, args.ranks), flush=True)
    results = {}
    if args.only != "diloco":
        results["one process"] = run_one_process(train, val, cfg)
    if args.only != "one":
        results[f"DiLoCo {args.ranks} ranks"] = run_diloco(train, val, cfg)
    print(f"# load average at the end {os.getloadavg()[0]:.2f}\n")
    print("| variant | steps (rank 0) | bytes trained (tokens: bytes) | bytes/s | train loss "
          "(last 20, nats/byte) | held-out loss (nats/byte) |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        last = statistics.mean(l for _, l in r["curve"][-20:])
        print(f"| {name} | {r['steps']} | {r['tokens']:,} | {r['tokens'] / r['wall_s']:,.0f} | "
              f"{last:.3f} | {r['val_loss']:.3f} |")
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"variant": name, "params": n_params, **cfg,
                                    **{k: v for k, v in r.items() if k != "curve"}}) + "\n")
    if args.plot:
        _plot(results, args.plot, n_params, cfg)
        print(f"\nplot: {args.plot}")
    return 0


def _plot(results: dict, path: str, n_params: int, cfg: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in results.items():
        t = np.array([c[0] for c in r["curve"]])
        loss = np.array([c[1] for c in r["curve"]])
        k = max(1, len(loss) // 50)
        smooth = np.convolve(loss, np.ones(k) / k, mode="valid")
        ax.plot(t[k - 1:], smooth, label=f"{name} (held-out {r['val_loss']:.3f})")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title(f"char LM on stdlib .py, {n_params / 1e6:.1f} M params, "
                 f"{cfg['threads']} threads, {available_cores()} cores", fontsize=10)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    run_main(main)
