"""Training throughput under torchrun on the CPU: 1 process against 2,
with DDP and with FSDP2.

Each run trains an MLP (32 -> 256 -> 256 -> 10, batch 64 per process) for
3 epochs on 16,384 samples with ``DistributedTrainer`` (gloo), one thread per
process, and reports samples per second over all processes. On a 2-core
machine this shows the overhead of the process group and the gradient
all-reduce (FSDP: parameter all-gathers and gradient reduce-scatters), not
scaling: two processes share two cores with everything else.

Run: ``.venv/bin/python benchmarks/distributed.py``
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

N, BS, EPOCHS = 16_384, 64, 3


def child() -> None:
    import torch
    from torch import nn
    from torch.nn import functional as F  # noqa: N812
    from torch.utils.data import DataLoader, TensorDataset

    from fitlib import DataBunch, Learner, ranks
    from fitlib.callbacks import DistributedTrainer

    torch.set_num_threads(1)
    strategy = sys.argv[sys.argv.index("--child") + 1]
    trainer = DistributedTrainer(backend="gloo", strategy=strategy)
    torch.manual_seed(0)
    x, y = torch.randn(N, 32), torch.randint(0, 10, (N,))
    data = DataBunch(DataLoader(TensorDataset(x, y), BS, shuffle=True), None, "cpu")
    model = nn.Sequential(
        nn.Linear(32, 256), nn.ReLU(),
        nn.Linear(256, 256), nn.ReLU(),
        nn.Linear(256, 10),
    )  # fmt: skip
    learn = Learner(data, model, F.cross_entropy, metrics=[], progress=False,
                    callbacks=[trainer])  # fmt: skip
    start = time.perf_counter()
    learn.fit(EPOCHS, lr=1e-3)
    seconds = time.perf_counter() - start
    if ranks.is_main():
        print(json.dumps({"seconds": seconds, "world": ranks.world_size()}))


def run(n: int, strategy: str) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={n}", __file__, "--child", strategy]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return N * EPOCHS / result["seconds"]


def main() -> None:
    runs = [(n, s) for s in ("ddp", "fsdp") for n in (1, 2)]
    rates = {r: [] for r in runs}
    for _ in range(3):  # interleaved: drifts of the machine hit all alike
        for n, strategy in runs:
            rates[n, strategy].append(run(n, strategy))
    best = {r: max(v) for r, v in rates.items()}
    for n, strategy in runs:
        print(f"{strategy}, {n} process(es): {best[n, strategy]:,.0f} samples/s "
              "(best of 3)")  # fmt: skip
    for strategy in ("ddp", "fsdp"):
        ratio = best[2, strategy] / best[1, strategy]
        print(f"{strategy}: 2 processes / 1 process: {ratio:.2f}x")
    print(f"fsdp / ddp, 2 processes: {best[2, 'fsdp'] / best[2, 'ddp']:.2f}x")


if __name__ == "__main__":
    child() if "--child" in sys.argv else main()
