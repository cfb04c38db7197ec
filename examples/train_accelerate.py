"""A Hugging Face Accelerate training loop (a tiny Llama built from its config) protected by ckptless: the lines
marked `# ckptless` are all it takes. Run it with the project's torchrun-like runner, and kill a worker on the way:

    python -m ckptless_core.run --nproc 2 --spares 1 --on-no-spare wait --fault kill_worker:1:20 \
        examples/train_accelerate.py --steps 40

Accelerate places the model on this worker's device, runs mixed precision, scales the loss for gradient
accumulation (`accelerator.backward`) and clips gradients (`accelerator.clip_grad_norm_`); ckptless forms the
process groups (one per generation), averages the gradients, recovers and replays. So the Accelerator is built as
one process: the torchrun-like variables a ckptless worker has are hidden while it is built (otherwise Accelerate
starts a process group of its own from them, or adopts the generation's and wraps the model in DDP; see
docs/own-script.md). The data-parallel rank and world are `replica.rank` and `replica.world_size`, never
Accelerate's `process_index` and `num_processes`. The final parameter hash it prints is the same as without the fault.
"""

import argparse
import json
import os

import torch
from accelerate import Accelerator
from accelerate.utils import patch_environment
from transformers import LlamaConfig, LlamaForCausalLM

from ckptless_core.grad_sync import FlatGradients  # ckptless
from ckptless_core.replica import Replica, WorkerState  # ckptless
from ckptless_core.state_hash import param_sha256
from ckptless_core.transfer import materialize_optimizer_state, state_tensors  # ckptless

VOCAB, SEQ_LEN = 64, 32

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (all workers together)")
parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per worker and step")
parser.add_argument("--mixed-precision", choices=("no", "bf16"), default="bf16")
args = parser.parse_args()
num_workers = int(os.environ.get("WORLD_SIZE", "1"))
if args.batch % (args.grad_accum * num_workers):
    parser.error(
        f"--batch {args.batch} must be a multiple of --grad-accum x workers ({args.grad_accum} x {num_workers}): "
        "every worker runs the same number of equal micro-batches"
    )

replica = Replica.from_environ()  # ckptless: link to the node agent, heartbeat, membership
device = f"cuda:{replica.env.local_rank}" if replica.backend == "nccl" else "cpu"  # ckptless: the slot's device
with patch_environment(local_rank=-1, world_size=1, accelerate_torch_device=device):  # ckptless: one process
    accelerator = Accelerator(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)

torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=SEQ_LEN,
)
model = LlamaForCausalLM(config)
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
grads = FlatGradients(model.parameters())  # every .grad a view into one buffer: one all-reduce per step

materialize_optimizer_state(optimizer.optimizer)  # ckptless: so a spare holds the same state layout
replica.start(WorkerState(state_tensors(model, optimizer.optimizer)))  # ckptless: what moves; a spare waits here


def micro_batches(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """This rank's micro-batches of `step`, a pure function of the step: any rank can be rebuilt at any step. Each
    sequence counts up from a random token in a random stride (1 to 3): learnable from its first tokens."""
    generator = torch.Generator().manual_seed(step)
    start = torch.randint(VOCAB, (args.batch, 1), generator=generator)
    stride = torch.randint(1, 4, (args.batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(SEQ_LEN)) % VOCAB
    per_rank = args.batch // world_size
    return tokens[rank * per_rank : (rank + 1) * per_rank].to(accelerator.device).chunk(args.grad_accum)


def train_step(step: int) -> float:
    grads.zero()
    for tokens in micro_batches(step, replica.rank, replica.world_size):
        share = model(input_ids=tokens, labels=tokens).loss / replica.world_size  # the ranks' shares sum to the mean
        accelerator.backward(share)  # divides by gradient_accumulation_steps
        grads.scalars[0] += share.detach() / args.grad_accum
    replica.all_reduce(grads.buffer)  # ckptless: a failed peer surfaces here as a recoverable error
    accelerator.clip_grad_norm_(model.parameters(), 1.0)
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
