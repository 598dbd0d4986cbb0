"""A plain DDP script on the "flodl_shm" backend, as torchrun runs it (tests/test_c10d_torchrun.py).

Writes ``<out>/rank<R>.pt``: the host identity, an all_reduce result, the trained
parameters, and an all_reduce of a second group created after the first was destroyed. ``python -m torch.distributed.run ... c10d_torchrun_script.py OUT``.
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flodl_shm  # noqa: F401 - registers the "flodl_shm" backend

torch.set_num_threads(1)
dist.init_process_group("flodl_shm")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.full((5,), float(rank + 1))
dist.all_reduce(t)
torch.manual_seed(rank)  # different inits: DDP's initial broadcast aligns them
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
g = torch.Generator().manual_seed(100 + rank)
for _ in range(3):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)),
                                 torch.randn(4, 1, generator=g)).backward()
    opt.step()
params = [p.detach().clone() for p in model.parameters()]
dist.destroy_process_group()
# a new group in the same processes, on torchrun's same store: it must not read the
# old group's keys (its arena is gone)
dist.init_process_group("flodl_shm")
again = torch.full((3,), float(rank + 1))
dist.all_reduce(again)
dist.destroy_process_group()
torch.save({"host": os.environ.get("FLODL_SHM_HOST"), "pid": os.getpid(), "sum": t,
            "again": again, "world": world, "local_rank": int(os.environ["LOCAL_RANK"]),
            "params": params},
           os.path.join(sys.argv[1], f"rank{rank}.pt"))
