"""The typed job configuration: one dataclass per config section.

The launcher composes these from the Hydra tree and validates them; workers load the resolved
`config.yaml` back into the same dataclasses with `load_config`, without Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from omegaconf import OmegaConf

from ckptless_core.faults import FaultEvent


@dataclass
class RunConfig:
    dir: str | None = None
    """Run directory; default `outputs/<recipe>/<timestamp>` under the current directory."""
    overwrite: bool = False
    """Allow writing into an existing non-empty run directory."""


@dataclass
class ModelConfig:
    hf_config: dict[str, Any] = field(default_factory=dict)
    """Hugging Face config fields, `model_type` first (`llama`, `gpt_oss`, ...); built with `AutoConfig.for_model`."""
    pretrained: str | None = None
    """Local directory with a Hugging Face config and weights; replaces `hf_config` when set."""
    attn_implementation: str = "eager"
    """Attention kernel passed to transformers (`eager`, `sdpa`, ...)."""


@dataclass
class TokenizerConfig:
    path: str | None = None
    """Local Hugging Face tokenizer directory; null means the built-in byte-level tokenizer."""


@dataclass
class DataConfig:
    source: str = "synthetic"
    """`synthetic` (the built-in corpus: text, or conversations for `task=sft`/`lora`), `text_files`, `hf_dataset`
    (text) or `chat` (conversations)."""
    paths: list[str] = field(default_factory=list)
    """Files to read for `text_files`, and for `hf_dataset` and `chat` from local files."""
    name: str | None = None
    """`hf_dataset` and `chat`: a dataset name on the hub (needs network) instead of `paths`."""
    split: str = "train"
    """`hf_dataset` and `chat`: the split to read."""
    text_field: str = "text"
    """`hf_dataset` only: the column that holds the text."""
    messages_field: str = "messages"
    """`chat` only: the column that holds each conversation, a list of `{"role": ..., "content": ...}`."""
    seq_len: int = 128
    """Tokens per training sample (the model sees `seq_len` inputs and predicts `seq_len` targets)."""
    synthetic_num_bytes: int = 2_000_000
    """`synthetic` only: size of the generated corpus."""
    cache_dir: str | None = None
    """Where token files are cached; default `$CKPTLESS_CACHE` or `~/.cache/ckptless`."""
    eval_fraction: float = 0.01
    """With evaluation on (`eval.every`) and no `eval.paths`: the held-out part, the last this fraction of the token
    file or of the packed conversations, never sampled for training."""


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate the validation loss on held-out data after every this many steps and after the last one; 0: never
    (the default: training then samples from all of the data)."""
    samples: int | None = None
    """Held-out samples per evaluation, the same ones each time; null: one global batch."""
    paths: list[str] = field(default_factory=list)
    """Files to evaluate on, read as `data.paths` are (same source kind); empty: hold out `data.eval_fraction`."""


@dataclass
class TaskConfig:
    kind: str = "pretrain"
    """`pretrain` (next-token loss on every token), `sft` (supervised fine-tuning on conversations: loss on the
    assistant's tokens only, short conversations packed into `data.seq_len`) or `lora` (`sft` training low-rank
    adapters only, with `peft`; the base model frozen)."""


@dataclass
class LoraConfig:
    rank: int = 8
    """Rank of each adapter (peft's `r`)."""
    alpha: float = 8.0
    """Scaling numerator: adapters are scaled by `alpha / rank` (peft's `lora_alpha`)."""
    dropout: float = 0.0
    """Dropout on the adapters' input (peft's `lora_dropout`)."""
    target_modules: list[str] | None = None
    """Module names to adapt (`q_proj`, `v_proj`, ...); null: peft's default for the architecture."""


@dataclass
class TrainerConfig:
    max_steps: int = 100
    """Optimizer steps to run."""
    global_batch_size: int = 16
    """Samples per optimizer step, over all data-parallel workers."""
    micro_batch_size: int = 8
    """Samples per forward/backward on one worker; accumulation fills the rest of the global batch."""
    grad_clip_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""
    precision: str = "fp32"
    """`fp32`, or `bf16` autocast (fp32 master weights); sharded, FSDP2 also gathers bf16 parameters and reduces
    gradients in fp32."""
    activation_checkpointing: bool = False
    """Recompute each decoder block's activations in the backward pass instead of keeping them: less memory for
    about a third more compute."""
    compile: bool = False
    """`torch.compile` each decoder block: the first step compiles them (a spare compiles while it warms up; a
    sharded job compiles its fresh model again in each generation's rebuild)."""
    log_every: int = 1
    """Write a `metrics.jsonl` line every this many steps."""
    print_every: int = 10
    """Print a console line every this many steps."""


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay, applied to matrices only (not to norms, biases or 1-D tensors)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 10
    """Linear warmup from 0 to `lr`."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at `lr * min_lr_ratio` at `trainer.max_steps`."""


@dataclass
class ParallelConfig:
    shard: int = 1
    """Ranks each copy of the model and optimizer state is sharded over (FSDP2 `fully_shard` on every decoder
    block, then the root); 1: every rank holds a full replica."""
    replicate: int | None = None  # noqa: UP007 - OmegaConf reads `typing.Optional`
    """Copies of the state (replica groups); `cluster.nproc` = `shard` x `replicate`. Null: `nproc / shard`."""


@dataclass
class ClusterConfig:
    kind: str = "local"
    """Where workers run: `local` (one host: this machine), `netns` (emulated hosts on this machine, each its own
    network, PID and UTS namespace; needs root), `hosts` (node agents started by hand on real hosts), `slurm`
    (submitted with sbatch) or `k8s` (a JobSet's manifests)."""
    nproc: int | None = 2  # noqa: UP007 - OmegaConf reads `typing.Optional`
    """Data-parallel workers in all (spares not counted); null: `num_hosts` x `nproc_per_host`."""
    num_hosts: int = 1
    """Training hosts (spare hosts not counted); each runs a node agent."""
    nproc_per_host: int = 0
    """Workers per training host; 0: `nproc` / `num_hosts`."""
    spare_hosts: int = 0
    """Whole hosts of `nproc_per_host` hot spares each, beside `ft.spares` spare workers on the training hosts."""
    coordinator_address: str = "127.0.0.1"
    """`hosts`: the address of this machine the coordinator binds and agents connect to (its control channel and
    the collective backend's rendezvous store listen there only)."""
    coordinator_port: int = 0
    """`hosts`: the control channel's port (0: any free port, printed with the agent command)."""
    backend: str = "auto"
    """Collective backend: `auto` (NCCL when CUDA is present, else gloo), `gloo` or `nccl`."""
    threads_per_worker: int = 0
    """torch intra-op threads per worker; 0 means CPU cores divided by `nproc` (at least 1)."""
    collective_timeout_s: float = 120.0
    """Timeout of every collective and of the process-group rendezvous."""
    start_timeout_s: float = 300.0
    """How long workers may take to start and join before the job fails."""
    memory_limit_gib: float | None = None
    """Memory available to the job for the fit check; default: what this machine reports as available."""
    ifname: str | None = None
    """`slurm`, `k8s`: the nodes' network interface for the collective backend and the control channel (the
    coordinator binds its address); default: the address the node's hostname resolves to (`slurm`), the pod's
    address (`k8s`)."""
    python: str | None = None
    """`slurm`: the interpreter on the nodes; default: the launcher's own (`sys.executable`)."""
    partition: str | None = None
    """`slurm`: the partition (`--partition`); default: the cluster's default partition."""
    account: str | None = None
    """`slurm`: the account charged (`--account`)."""
    time: str | None = None
    """`slurm`: the time limit (`--time`, e.g. `24:00:00`); the coordinator is warned `time_warning_s` before it
    and stops the job cleanly with a final checkpoint."""
    time_warning_s: int = 300
    """`slurm`: how long before the time limit the coordinator is signalled (`--signal=B:TERM@...`)."""
    sbatch_args: list[str] = field(default_factory=list)
    """`slurm`: extra `#SBATCH` lines for every job of the run, e.g. `[--qos=high, --constraint=h100]`."""
    srun_prefix: str = "srun --ntasks=1"
    """`slurm`: what starts each process in its allocation; a container wrapper goes here, e.g. `srun --ntasks=1
    --container-image=nvcr.io#nvidia/pytorch:25.01-py3` (pyxis) or `srun --ntasks=1 apptainer exec img.sif`."""
    host_replacements: int = 4
    """`slurm`: a host lost (or leaving) is replaced by submitting one more host task at once, which joins as a spare
    host; at most this many per job (0: none). Those still queued when the job ends are cancelled."""
    detach: bool = False
    """`slurm`: return right after submitting (the job runs on; `python -m launcher.follow <run dir>` follows it)."""
    shared_run_dir_ok: bool = False
    """`slurm`: accept a run directory under /tmp (refused by default: every node must see the run directory)."""
    image: str = "ghcr.io/ckptless/ckptless:0.1.0"
    """`k8s`: the container image of every pod (ckptless and its dependencies installed)."""
    namespace: str = "default"
    """`k8s`: the namespace of the JobSet, its Service and its Secret."""
    volume: str = "ckptless-runs"
    """`k8s`: a ReadWriteMany PersistentVolumeClaim holding the run directory (the coordinator's journal outlives
    its pod there)."""
    mount_path: str = "/runs"
    """`k8s`: where the volume is mounted in every pod; the pods' run directory is `<mount_path>/<run name>`."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """`k8s`: the pods' `nodeSelector`."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """`k8s`: the pods' `tolerations`, as Kubernetes writes them."""


@dataclass
class FtConfig:
    mode: str = "ckptless"
    """`ckptless` (recover in place from failures), `checkpoint_restart` (the usual baseline: torchrun restarts
    every worker and reloads the latest disk checkpoint) or `none` (plain data parallelism: a failure ends the job)."""
    spares: int = 1
    """Hot spares kept ready (imported, model built) to replace a failed worker."""
    heartbeat_interval_s: float = 0.5
    """How often each worker reports that it is alive."""
    heartbeat_timeout_s: float = 5.0
    """A worker silent this long is declared hung, fenced (SIGKILL) and replaced."""
    host_timeout_s: float = 2.0
    """A host whose node agent is silent this long is lost with every process on it, and its ranks replaced."""
    stall_timeout_s: float = 10.0
    """A rank alive but not arriving at a collective that the others have waited in this long is blamed for the
    stall (stuck main thread), fenced and replaced; must exceed the longest forward/backward of a step."""
    progress_deadline_s: float = 600.0
    """No step committed for this long ends the job (exit 4), naming the ranks that did not arrive."""
    on_no_spare: str = "shrink"
    """Without a ready spare: `shrink` (fewer ranks, more accumulation, same global batch), `wait`, or `fail`."""
    max_failures_without_progress: int = 3
    """End the job (exit code 4) after this many failures in a row with no step committed in between."""
    recovery_timeout_s: float = 60.0
    """Longest wait for a new generation to form during recovery."""
    lease_s: float | None = None
    """A host that hears nothing from the coordinator this long while none of its workers commits a step is cut
    off: its agent fences them itself (SIGKILL; nothing more reaches the run directory), before the coordinator
    gives their ranks to others at `host_timeout_s`. Below `host_timeout_s`; null: 3/4 of it."""
    coordinator_timeout_s: float | None = None
    """How long node agents keep their workers without a coordinator (it died and is being restarted); then they
    stop them and exit (code 3). Steps go on meanwhile; a failure in that time is handled once it is back. null: the
    cluster kind's default, longer than what brings a coordinator back there: 30 s where the launcher restarts it
    in place (`local`, `netns`, `hosts`), 900 s on `slurm` (a requeue waits until Slurm marks the node down,
    `SlurmdTimeout`: 300 s by default), 600 s on `k8s` (a pod on an unreachable node is evicted after 300 s)."""
    checkpoint_every: Union[int, str] = 0  # noqa: UP007 - OmegaConf reads `typing.Union`, not `int | str`
    """Write a disk checkpoint every this many steps; `auto`: the Young-Daly interval sqrt(2 x write cost x
    `mtbf_s`), from the measured write cost and step time; 0: no checkpoints. In `ckptless` mode they are written in
    the background and serve when no healthy peer holds the state, `resume=`, and preemption; in
    `checkpoint_restart` mode training waits for each write and every restart reloads the latest."""
    keep_checkpoints: int = 3
    """Disk checkpoints kept: after each write only the newest this many remain (0 keeps every one)."""
    mtbf_s: float = 3600.0
    """Expected mean time between failures of the whole job, for `checkpoint_every=auto`."""
    max_restarts: int = 10
    """`checkpoint_restart`: torchrun's `--max-restarts` (restarts of the whole worker group before failing)."""
    on_straggler: str = "replace"
    """A straggler (a rank whose compute takes `straggler_factor` times the median of the others' for
    `straggler_window_steps` steps in a row): `replace` moves its rank to a ready spare at a step boundary (only
    reported while none is ready), `report` reports it, `off`. `ft=none` and `ft=checkpoint_restart` accept `off` only."""
    straggler_factor: float = 1.5
    """How many times the median compute of the other ranks makes a rank slow."""
    straggler_window_steps: int = 20
    """For how many steps in a row a rank must be slow to be a straggler."""
    drain_grace_s: float = 60.0
    """A host leaving (SIGTERM to its agent, `python -m launcher drain`) when no spare is ready, under
    `on_no_spare=wait`: it keeps training until a spare is ready or this long has passed; then the job shrinks."""
    drain_timeout_s: float = 120.0
    """A leaving host's agent goes after this long even if its ranks were not handed over (its workers killed: the
    coordinator takes it for a lost host). What stops a host (Kubernetes' `terminationGracePeriodSeconds`, Slurm's
    `KillWait`) must give it longer; above `drain_grace_s`."""
    check_every: int = 50
    """Every this many steps the replicas compare a checksum of their state; a rank outside the majority (ties:
    the lowest rank wins) is reported as corrupt and repaired from a peer. 0 disables."""


@dataclass
class LoggingConfig:
    tensorboard: bool = False
    """Write the run's charts as TensorBoard event files under `<run dir>/tensorboard/` (`pip install tensorboard`)."""
    wandb: bool = False
    """Log the run's charts to Weights & Biases (`pip install wandb`), its local files under `<run dir>/wandb/`."""
    wandb_project: str = "ckptless"
    """The W&B project the run goes to."""
    wandb_entity: str | None = None
    """The W&B entity (user or team); null: the account's default."""
    wandb_mode: str = "offline"
    """`offline` (written under `<run dir>/wandb/`, uploaded later with `wandb sync`; needs no network) or `online`
    (streamed as the run goes; needs network and a W&B API key where the job is served)."""


@dataclass
class FaultConfig(FaultEvent):
    kind: str = "none"
    """`none`, or a fault kind injected during the run (see `configs/fault/`)."""
    more: list[FaultEvent] = field(default_factory=list)
    """Further fault events in the same run, e.g. `fault.more=[{kind:kill_worker,rank:2,step:40}]`."""

    def events(self) -> list[FaultEvent]:
        """All fault events of the run: the one in the flat fields (unless `none`), then `more`."""
        first = (
            []
            if self.kind == "none"
            else [FaultEvent(**{k: getattr(self, k) for k in FaultEvent.__dataclass_fields__})]
        )
        return first + list(self.more)


@dataclass
class JobConfig:
    seed: int = 0
    """Seeds model initialisation and the data order."""
    dry_run: bool = False
    """Print the plan (model size, memory per rank, tokens per step, worker commands) and start nothing."""
    resume: str | None = None
    """Run directory of a job lost as a whole: start from its latest disk checkpoint (`ft.checkpoint_every`)."""
    run: RunConfig = field(default_factory=RunConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    ft: FtConfig = field(default_factory=FtConfig)
    fault: FaultConfig = field(default_factory=FaultConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


def load_config(path: str | Path) -> JobConfig:
    """Read a resolved `config.yaml` (as the launcher wrote it) into a `JobConfig`; unknown keys are refused."""
    schema = OmegaConf.structured(JobConfig)
    merged = OmegaConf.merge(schema, OmegaConf.load(path))
    return OmegaConf.to_object(merged)


def save_config(config: JobConfig, path: str | Path) -> None:
    """Write `config` as YAML that `load_config` reads back to an equal object."""
    Path(path).write_text(OmegaConf.to_yaml(OmegaConf.structured(config)))
