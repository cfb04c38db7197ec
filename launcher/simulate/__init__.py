"""Scale simulator: goodput of checkpoint-restart vs checkpointless recovery on N accelerators with failures.

A discrete-event simulation of a data-parallel job, run for each size N, compares two strategies:

- `checkpoint_restart` (torchrun --max-restarts + periodic disk checkpoints): a failure costs detection, a whole-job
  restart, a checkpoint load, and redoing the work since the last completed checkpoint.
- `ckptless`: a failure costs detection, a communicator rebuild, a peer-to-peer state transfer to a hot spare and the
  partial step in flight; the step is replayed. Spare accelerators are reported beside goodput, not inside it.

Goodput = committed steps x fault-free step time / wall time of the training phase.
Lost accelerator-hours = (wall - productive time) x N / 3600.

Costs are given at `CostModel.reference_world_size` and scaled to N only by the assumptions in
`SCALING_ASSUMPTIONS` (`--assumptions` prints them), never by fitting local runs. Sources:
- Dubey et al. 2024, "The Llama 3 Herd of Models", sec. 3.3.4: 419 unexpected interruptions in 54 days on 16,384
  H100 GPUs (failure rate linear in N); per-GPU checkpoints written in parallel to Tectonic.
- Si et al. 2025, "Collective Communication for 100k+ GPUs" (NCCLX, arXiv:2510.20171): stock NCCL bootstrap and
  connection setup take minutes (~265 s) at ~96k GPUs; Jiang et al. 2024, "MegaScale" (NSDI '24): initialization
  at >10k GPUs must be engineered to stay short. Both justify a restart/rebuild term growing with N.
- torch.distributed.checkpoint docs: every rank saves and loads its own shard in parallel.
- Young 1974 (CACM) "A first order approximation to the optimum checkpoint interval": tau = sqrt(2 * write * MTBF);
  Daly 2006 (FGCS) "A higher order estimate of the optimum checkpoint interval for restart dumps".

Modules: `costs` (cost and failure models, scaling assumptions), `engine` (the event loop), `calibration` (costs
from a measured run, predictions), `__main__` (the CLI: `python -m launcher.simulate --help`).
"""
