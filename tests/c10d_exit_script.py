"""A rank that leaves a multi-host "flodl_shm" group without destroying it
(tests/test_c10d_torchrun.py): a sparse and a float64 all_reduce, which cross the
hosts through the leaders' gloo group, then the interpreter's exit.
``python c10d_exit_script.py INIT_METHOD RANK WORLD`` (FLODL_SHM_HOST tells the hosts
apart)."""
import sys
import warnings

import torch
import torch.distributed as dist

import flodl_shm  # noqa: F401 - registers the "flodl_shm" backend

warnings.filterwarnings("ignore", message=".*[Ss]parse.*")
init, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
dist.init_process_group("flodl_shm", init_method=init, rank=rank, world_size=world)
t = torch.sparse_coo_tensor(torch.tensor([[rank]]), torch.tensor([1.0]), (world,))
dist.all_reduce(t)
d = torch.ones(2, dtype=torch.float64)
dist.all_reduce(d)
assert t.to_dense().tolist() == [1.0] * world and d.tolist() == [float(world)] * 2
print("done", flush=True)  # and no dist.destroy_process_group()
