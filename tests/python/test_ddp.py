"""DistributedDataParallel over attnkit.nn modules: two gloo processes on
loopback, each with half of every batch, end with the parameters of one
process that sees the whole batch (issue 14; the Python side of issue 16)."""
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import attnkit

STEPS, BATCH, L, D = 3, 8, 12, 16


def build():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        attnkit.nn.Linear(D, D),
        Attention(),
        attnkit.nn.Linear(D, 5))


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mha = attnkit.nn.MultiheadAttention(D, 4, attention="full", batch_first=True)

    def forward(self, x):
        return self.mha(x, x, x, is_causal=True)[0]


def data():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, L, D, generator=generator), torch.randint(0, 5, (BATCH, L), generator=generator))
            for _ in range(STEPS)]


def train(model, batches, rank=0, world=1):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    share = BATCH // world
    for x, y in batches:
        x, y = x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def worker(rank, world, port, out):
    # USE_LIBUV=0: torch >= 2.4 asks for TCPStore's libuv backend by default,
    # which Debian 13's torch 2.6 is built without (torch 1.13 ignores it).
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), USE_LIBUV="0")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        model = torch.nn.parallel.DistributedDataParallel(build())
        train(model, data(), rank, world)
        if rank == 0:
            torch.save(model.module.state_dict(), out)
    finally:
        dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_gloo_processes_equal_one_process_with_both_halves(tmp_path):
    out = tmp_path / "ddp.pt"
    mp.start_processes(worker, args=(2, free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    ddp = torch.load(out)
    single = build()
    train(single, data())
    # Each rank's gradient is the mean over its half; DDP averages the two, which
    # is the mean over the whole batch up to float32 rounding of the sums in a
    # different order: a few ulps per step, 1e-6 after 3 steps of SGD.
    for name, value in single.state_dict().items():
        torch.testing.assert_close(ddp[name], value, rtol=1e-5, atol=1e-6, msg=name)
    before = build().state_dict()
    assert any(not torch.equal(before[n], v) for n, v in single.state_dict().items()), "training changed nothing"
