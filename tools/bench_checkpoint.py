#!/usr/bin/env python
"""Benchmark: writing a consensus checkpoint, side by side with its peers, in one run.

Writes the same model (default 1 GiB of f32 as 16 x 4096 x 4096 tensors, the
peers' checkpoint-write benchmark shape, BENCHMARKS.md "Checkpoint writes") as:

- ``forge .fdl (f32 payloads)``: ``write_consensus_fdl`` from the consensus
  frame's payload bytes — the path ``CheckpointForge`` runs on its writer thread
  (temp + fsync + atomic rename + directory fsync);
- ``forge .fdl (bf16 payloads)``: the same from a bf16-wire consensus (half the
  bytes in, every value upcast to f32 on the way out);
- ``CheckpointForge.accumulate`` (caller's time): what the reduce thread pays
  to hand the frame over (the write itself runs in the background; the total
  until ``flush()`` returns is reported too);
- ``torch.save(state_dict) + fsync``;
- ``safetensors (flodl_shm writer) + fsync``;
- ``raw write + fsync``: the bytes alone, the floor.

Every variant fsyncs, runs ``--repeats`` times interleaved, and is deleted after
each run. Prints a markdown table (median and best wall time, GiB/s, ratio to
the raw write).

    python tools/bench_checkpoint.py            # 1 GiB, 5 repeats (~1-3 min, the disk's speed)
    python tools/bench_checkpoint.py --size-mib 256 --repeats 5 --dir /mnt/fast
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _bench_common import existing_dir, parser, positive_int, run_main  # noqa: E402
from flodl_shm.checkpoint.convert import save_safetensors  # noqa: E402
from flodl_shm.checkpoint.forge import CheckpointForge, write_consensus_fdl  # noqa: E402
from flodl_shm.checkpoint.meta import ModelSchema  # noqa: E402
from flodl_shm.frame import DTYPE_BF16, DTYPE_F32, RoundFrame, TensorPayload  # noqa: E402


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__.split("\n\n")[0] + "\n\nThe default run (1 GiB, 5 repeats of 6 "
                "variants: 30 writes of 1-2 GiB) takes about 1-3 minutes, depending on the "
                "disk; --size-mib 256 --repeats 3 a quarter of a minute.")
    ap.add_argument("--size-mib", type=positive_int, default=1024, help="model size in MiB")
    ap.add_argument("--tensors", type=positive_int, default=16, help="number of equal tensors")
    ap.add_argument("--repeats", type=positive_int, default=5,
                    help="interleaved runs of every variant (median and best are printed)")
    ap.add_argument("--dir", type=existing_dir,
                    default=os.environ.get("CKPT_DIR", tempfile.gettempdir()),
                    help="an existing folder to write in (default $CKPT_DIR or the temp dir)")
    args = ap.parse_args(argv)
    if args.size_mib * (1 << 20) // 4 < args.tensors:
        ap.error(f"--tensors {args.tensors} is more than the {args.size_mib * (1 << 18)} "
                 f"float32 of --size-mib {args.size_mib}; give fewer tensors or a larger size")

    elems = args.size_mib * (1 << 20) // 4 // args.tensors
    torch.manual_seed(0)
    state = {f"layer{i}.weight": torch.randn(elems) for i in range(args.tensors)}
    total = sum(t.numel() * 4 for t in state.values())
    names = list(state)
    schema = ModelSchema(names, [])
    f32_payloads = [TensorPayload(DTYPE_F32, (elems,), t.numpy()) for t in state.values()]
    bf16_payloads = [TensorPayload(DTYPE_BF16, (elems,), t.bfloat16().view(torch.int16).numpy())
                     for t in state.values()]

    work = tempfile.mkdtemp(prefix="flodl_bench_ckpt_", dir=args.dir)
    # Load the numba upcast kernel once, outside the timings.
    write_consensus_fdl(ModelSchema(["w"], []), [TensorPayload(DTYPE_BF16, (4,), np.zeros(4, np.uint16))],
                        os.path.join(work, "warm.fdl"))
    os.remove(os.path.join(work, "warm.fdl"))
    results: dict[str, list[float]] = {}
    extra: dict[str, list[float]] = {}

    def timed(label: str, fn, path: str) -> None:
        t0 = time.perf_counter()
        fn(path)
        results.setdefault(label, []).append(time.perf_counter() - t0)
        for leftover in os.listdir(work):
            os.remove(os.path.join(work, leftover))

    def raw(path: str) -> None:
        with open(path, "wb") as fh:
            for t in state.values():
                fh.write(memoryview(t.numpy()).cast("B"))
            fh.flush()
            os.fsync(fh.fileno())

    def tsave(path: str) -> None:
        torch.save(state, path)
        _fsync_path(path)

    def forge_f32(path: str) -> None:
        write_consensus_fdl(schema, f32_payloads, path)

    def forge_bf16(path: str) -> None:
        write_consensus_fdl(schema, bf16_payloads, path)

    def forge_async(path: str) -> None:
        forge = CheckpointForge(schema)
        forge.arm(path)
        frame = RoundFrame(list(f32_payloads))
        t0 = time.perf_counter()
        forge.accumulate(frame)
        handed = time.perf_counter() - t0
        forge.flush()
        extra.setdefault("accumulate", []).append(handed)
        if forge.writes_completed != 1:
            raise RuntimeError("the forge did not write the checkpoint")

    def safetensors(path: str) -> None:
        save_safetensors(state, path)

    plan = [
        ("raw write + fsync", raw, "raw.bin"),
        ("torch.save(state_dict) + fsync", tsave, "m.pt"),
        ("forge .fdl from f32 payloads", forge_f32, "m.fdl"),
        ("forge .fdl from bf16 payloads", forge_bf16, "b.fdl"),
        ("CheckpointForge accumulate -> flush", forge_async, "a.fdl"),
        ("safetensors (flodl_shm writer) + fsync", safetensors, "m.safetensors"),
    ]
    print(f"# {total / (1 << 30):.2f} GiB f32 ({args.tensors} tensors of {elems} elements), "
          f"{args.repeats} repeats, writing under {args.dir}", file=sys.stderr)
    try:
        for r in range(args.repeats):
            for label, fn, name in plan:
                timed(label, fn, os.path.join(work, name))
                print(f"  run {r + 1}: {label}: {results[label][-1]:.2f} s", file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    floor = statistics.median(results["raw write + fsync"])
    best_floor = min(results["raw write + fsync"])
    gib = total / (1 << 30)
    # a shared disk stalls single writes by 2x at times: a median of 5 flips with a few,
    # the best of each variant (what the disk does when nothing else writes) does not
    print(f"| variant ({gib:.2f} GiB f32, {args.repeats} runs) | median s | best s | GiB/s "
          f"(median) | x raw write (medians) | x raw write (bests) |")
    print("|---|---:|---:|---:|---:|---:|")
    for label, _, _ in plan:
        med, best = statistics.median(results[label]), min(results[label])
        print(f"| {label} | {med:.2f} | {best:.2f} | {gib / med:.2f} | {med / floor:.2f} | "
              f"{best / best_floor:.2f} |")
    acc = extra["accumulate"]
    print(f"| `CheckpointForge.accumulate` (the reduce thread's share) | "
          f"{statistics.median(acc) * 1e6:.0f} µs | {min(acc) * 1e6:.0f} µs | - | - | - |")
    return 0


if __name__ == "__main__":
    run_main(main)
