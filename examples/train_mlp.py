"""A plain PyTorch training script (no Hugging Face, no Hydra) protected by ckptless: the lines marked `# ckptless`
are all it takes. Run it with the project's torchrun-like runner, and kill a worker on the way:

    python -m ckptless_core.run --nproc 2 --spares 1 --on-no-spare wait --fault kill_worker:1:30 \
        examples/train_mlp.py --steps 60

The final parameter hash it prints is the same as without the fault: the spare takes the lost rank (`wait` holds the
job for it if it is still starting; the default, `shrink`, would go on with one rank, whose whole-batch steps round
differently in the last bits).
"""

import argparse
import json
import os

import torch

from ckptless_core.grad_sync import FlatGradients  # ckptless
from ckptless_core.replica import Replica, WorkerState  # ckptless
from ckptless_core.state_hash import param_sha256
from ckptless_core.transfer import materialize_optimizer_state, state_tensors  # ckptless

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=60)
parser.add_argument("--batch", type=int, default=32, help="global batch (all workers together)")
args = parser.parse_args()

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
grads = FlatGradients(model.parameters())  # every .grad a view into one buffer: one all-reduce per step

replica = Replica.from_environ()  # ckptless: link to the node agent, heartbeat, membership
materialize_optimizer_state(optimizer)  # ckptless: so a spare holds the same state layout
replica.start(WorkerState(state_tensors(model, optimizer)))  # ckptless: what moves to a replacement; a spare waits here


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Samples as a pure function of the step: any rank can be rebuilt at any step."""
    generator = torch.Generator().manual_seed(step)
    x = torch.randn(args.batch, 16, generator=generator)
    y = x[:, :4].sum(dim=1, keepdim=True).sin()
    per_rank = args.batch // world_size
    return x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]


def train_step(step: int) -> float:
    grads.zero()
    x, y = batch(step, replica.rank, replica.world_size)
    loss = torch.nn.functional.mse_loss(model(x), y, reduction="sum") / args.batch
    loss.backward()
    grads.scalars[0] += loss.detach()
    replica.all_reduce(grads.buffer)  # ckptless: a failed peer surfaces here as a recoverable error
    with replica.critical_section():  # ckptless: no half-applied update survives
        optimizer.step()
    return grads.scalars[0].item()


while replica.step < args.steps:
    loss = replica.run_step(train_step)  # ckptless: on a failure, recover and replay this step
digest = param_sha256(model.state_dict())
if replica.rank == 0:
    print(json.dumps({"steps": replica.step, "loss": loss, "param_sha256": digest}), flush=True)
    result = os.path.join(os.environ.get("CKPTLESS_RUN_DIR", "."), "result.json")
    with open(result, "w") as out:
        json.dump({"steps": replica.step, "loss": loss, "param_sha256": digest}, out)
replica.close()
