"""LocalSGD with comm=None on a "flodl_shm" default process group, as torchrun runs it
(tests/test_local_sgd_torchrun.py). ``python -m torch.distributed.run ...
local_sgd_torchrun_script.py OUT``: one process group carries three runs, one after
another, each writing ``<out>/rank<R>.<run>.pt``: the weights after construction, the
weights entering the last sync, the consensus, the sync's mass and how many of its rounds
reduced in the shared parameter blocks.

- ``small``: a LocalSGD of a small model, one window;
- ``big``: a 9 MiB model (its parameters go to the shared parameter blocks), two windows
  (both reduce in the blocks: the group settled the direct path when it formed);
- ``diloco``: a small model synced through ``DiLoCo`` (its outer step in the reduce, in
  the arena's outer segment)."""
import os
import sys

import torch
import torch.distributed as dist

import flodl_shm

torch.set_num_threads(1)
dist.init_process_group("flodl_shm")
rank = dist.get_rank()


def run(name: str) -> None:
    big = name == "big"
    torch.manual_seed(rank)                     # different inits: construction aligns them
    width = 1536 if big else 16
    layers = [torch.nn.Linear(8, width), torch.nn.ReLU()]
    if big:
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 2))
    sgd = (flodl_shm.DiLoCo(model, sync_every=2) if name == "diloco"  # comm=None: the
           else flodl_shm.LocalSGD(model, sync_every=2))               # default group
    mapped = sgd.comm._engine.direct.mapped_rounds
    init = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for window in range(2 if big else 1):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(4, 8, generator=g)),
                                     torch.randn(4, 2, generator=g)).backward()
        opt.step()
        assert sgd.step(samples=3 + rank) is False
        local = [p.detach().clone() for p in model.parameters()]
        assert sgd.step(samples=3 + rank) is True          # the window's last step: sync
    torch.save({"init": init, "local": local,
                "after": [p.detach().clone() for p in model.parameters()],
                "mass": sgd.last_sync.mass, "accepted": sgd.last_sync.accepted,
                "pid": os.getpid(), "shared_params": sgd.shared_params,
                "mapped_rounds": sgd.comm._engine.direct.mapped_rounds - mapped},
               os.path.join(sys.argv[1], f"rank{rank}.{name}.pt"))


for name in ("small", "big", "diloco"):
    run(name)
dist.destroy_process_group()
