"""docs/c10d.md's "Restarting with torchrun --max-restarts" recipe, as torchrun runs it
(tests/test_c10d_torchrun_restart.py).

``python -m torch.distributed.run --max-restarts 1 ... c10d_restart_script.py OUT STEPS KILL``

``train`` below is the recipe's code block verbatim (the test compares them). Around
it: a small DDP model with SGD momentum (so the optimizer state must be resumed too),
batches that depend only on (step, rank), and when KILL >= 0 rank 1 SIGKILLs itself
entering step KILL in the first attempt only (``OUT/killed`` marks that it happened).
Writes ``OUT/rank<R>_pid<PID>.json`` (pid, torchrun's restart count, start time, the
first step the loop asked data for) when a rank's process starts, and ``OUT/rank<R>.pt``
(the final parameters) at the end. (The record is named by pid, not by the restart
count: on several nodes the count differs between them, see docs/c10d.md.)
"""
import json
import signal
import sys
import time

# --- recipe (docs/c10d.md) ---
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flodl_shm  # noqa: F401 - registers "flodl_shm"


def train(model, opt, batches, steps, ckpt="ckpt.pt", every=100):
    dist.init_process_group("flodl_shm")
    start = 0
    if os.path.exists(ckpt):                           # written by rank 0 below
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"] + 1
    ddp = DDP(model)                                   # the init broadcast re-aligns every rank
    for step in range(start, steps):
        x, y = batches(step)                           # a step's data depends on the step only
        opt.zero_grad()
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if step % every == 0 and dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
                       ckpt + ".tmp")
            os.replace(ckpt + ".tmp", ckpt)            # atomic: a crash never leaves half a file
    dist.destroy_process_group()
# --- end of recipe ---


def main() -> None:
    out, steps, kill = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rank = int(os.environ["RANK"])
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    marker = os.path.join(out, "killed")

    record = {"pid": os.getpid(), "attempt": attempt, "started": time.time(),
              "first_step": None}

    def write_record() -> None:
        with open(os.path.join(out, f"rank{rank}_pid{os.getpid()}.json"), "w") as f:
            json.dump(record, f)

    write_record()

    def batches(step: int):
        if record["first_step"] is None:   # the step this attempt resumed at
            record["first_step"] = step
            write_record()
        if rank == 1 and step == kill and not os.path.exists(marker):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(1000 * step + rank)
        return torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)

    train(model, opt, batches, steps, ckpt=os.path.join(out, "ckpt.pt"), every=4)
    torch.save([p.detach().clone() for p in model.parameters()],
               os.path.join(out, f"rank{rank}.pt"))


if __name__ == "__main__":
    main()
