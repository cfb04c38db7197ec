"""Composing the Hydra config tree into a typed, validated `JobConfig` (the only place that runs Hydra)."""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import math
import shutil
import typing
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException, MissingConfigException
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from ckptless_core.checkpoint import checkpoint_dirs
from ckptless_core.faults import FaultEvent
from ckptless_core.membership import COMPUTE_KEPT
from launcher.clusters import KINDS, cluster_kind, is_scheduled
from launcher.errors import ConfigError
from recipes.data.sources import check_data_config
from recipes.schema import ClusterConfig, JobConfig, LoggingConfig, OptimConfig

CONFIG_MODULE = "configs"
VALID_PRECISIONS = ("fp32", "bf16")
VALID_BACKENDS = ("auto", "gloo", "nccl")
VALID_WANDB_MODES = ("offline", "online")
FAULT_KINDS_WITHOUT_RANK = ("chaos", "kill_sender", "kill_spare", "kill_coordinator")
"""Fault kinds whose target is not a rank `fault.rank` names: chosen while the job runs (a random rank, the state
sender, a spare) or not a worker (the coordinator); every other kind strikes the rank it names."""


@dataclass(frozen=True)
class ComposedJob:
    job: JobConfig
    """The typed, validated configuration."""
    recipe: str
    """The recipe option chosen (`tiny_llama`, ...)."""
    yaml: str
    """The composed config as YAML (what `--cfg job` prints)."""


FILE_RECIPE = "_from_file"
"""The name a recipe file (`recipe=path/to/my.yaml`) is composed under, beside the packaged recipes."""


def is_recipe_file(value: str) -> bool:
    """`recipe=` names a file rather than a packaged recipe: the value has a `/` or ends in `.yaml`."""
    return "/" in value or value.endswith((".yaml", ".yml"))


def compose_job(overrides: list[str]) -> ComposedJob:
    """Compose `configs/config.yaml` with command-line overrides; unknown keys and wrong types are refused. A recipe
    may be a YAML file (`recipe=my.yaml`, as `python -m launcher cp` writes one): composed as a packaged recipe is,
    and named after the file."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    overrides, recipe_file = _register_recipe_file(overrides)
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        recipe = str(cfg.hydra.runtime.choices.recipe)
        if recipe_file is not None:
            recipe = recipe_file.stem
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        # Re-merging into the schema refuses keys that `+key=value` overrides slipped past struct mode.
        job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.to_container(cfg)))
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_explain(error)) from None
    # The kind's own limits first: they name a better fix than the size rules below (one host on cluster=local).
    kind = cluster_kind(job.cluster.kind)
    refuse_other_kinds_options(job.cluster)
    kind.check(job)
    resolve_cluster_sizes(job.cluster)
    if job.ft.coordinator_timeout_s is None:
        job.ft.coordinator_timeout_s = kind.COORDINATOR_TIMEOUT_S
    validate(job)
    return ComposedJob(job=job, recipe=recipe, yaml=OmegaConf.to_yaml(cfg))


def _register_recipe_file(overrides: list[str]) -> tuple[list[str], Path | None]:
    """A `recipe=<file>` override: the file read and stored as the recipe `FILE_RECIPE`, and the override pointed at
    it. ConfigError when the file is missing or not a YAML mapping."""
    for i, override in enumerate(overrides):
        key, _, value = override.partition("=")
        if key != "recipe" or not is_recipe_file(value):
            continue
        path = Path(value).expanduser().absolute()
        if not path.is_file():
            raise ConfigError(
                f"recipe file {path} not found; python -m launcher cp <recipe> {value} writes one to edit"
            )
        try:
            node = OmegaConf.load(path)
        except (OSError, OmegaConfBaseException, ValueError) as error:
            raise ConfigError(f"recipe file {path} is not valid YAML: {error}") from None
        if not isinstance(node, DictConfig):
            raise ConfigError(f"recipe file {path} must hold a mapping of config fields (model:, trainer:, ...)")
        ConfigStore.instance().store(group="recipe", name=FILE_RECIPE, node=node, package="_global_")
        return [*overrides[:i], f"recipe={FILE_RECIPE}", *overrides[i + 1 :]], path
    return overrides, None


def refuse_other_kinds_options(cluster: ClusterConfig) -> None:
    """An option that only another kind reads (each kind's `OPTIONS`) is refused when set: it would be ignored."""
    defaults = ClusterConfig()
    for name in KINDS:
        if name == cluster.kind:
            continue
        for option in cluster_kind(name).OPTIONS:
            if option in cluster_kind(cluster.kind).OPTIONS or getattr(cluster, option) == getattr(defaults, option):
                continue
            raise ConfigError(
                f"cluster.{option} applies to {_kinds_reading(option)} only, not to cluster={cluster.kind}; "
                f"remove it, or choose {_kinds_reading(option)}"
            )


def _kinds_reading(option: str) -> str:
    return " or ".join(f"cluster={name}" for name in KINDS if option in cluster_kind(name).OPTIONS)


def resolve_cluster_sizes(cluster: ClusterConfig) -> None:
    """One set of names for every cluster kind: `nproc` = `num_hosts` x `nproc_per_host`; either side may be given
    (null `nproc`, or `nproc_per_host` 0, is derived from the other)."""
    if cluster.num_hosts < 1 or cluster.nproc_per_host < 0 or cluster.spare_hosts < 0:
        raise ConfigError(
            "cluster.num_hosts must be at least 1, cluster.nproc_per_host and cluster.spare_hosts 0 or more"
        )
    if cluster.nproc is None:
        cluster.nproc = cluster.num_hosts * max(cluster.nproc_per_host, 1)
    if not cluster.nproc_per_host:
        if cluster.nproc % cluster.num_hosts:
            raise ConfigError(
                f"cluster.nproc={cluster.nproc} workers do not divide over cluster.num_hosts={cluster.num_hosts} hosts; "
                "set cluster.nproc_per_host (and cluster.nproc=null) instead"
            )
        cluster.nproc_per_host = cluster.nproc // cluster.num_hosts
    if cluster.nproc != cluster.num_hosts * cluster.nproc_per_host:
        raise ConfigError(
            f"cluster.nproc={cluster.nproc} is not cluster.num_hosts ({cluster.num_hosts}) x cluster.nproc_per_host "
            f"({cluster.nproc_per_host}); set cluster.nproc=null to derive it"
        )


def validate(job: JobConfig) -> None:
    """Checks across fields that types alone cannot express; each message names the field and a fix."""
    trainer, cluster = job.trainer, job.cluster
    for name, value in (
        ("trainer.max_steps", trainer.max_steps),
        ("trainer.global_batch_size", trainer.global_batch_size),
        ("trainer.micro_batch_size", trainer.micro_batch_size),
        ("trainer.log_every", trainer.log_every),
        ("trainer.print_every", trainer.print_every),
        ("cluster.nproc", cluster.nproc),
        ("data.seq_len", job.data.seq_len),
    ):
        if value < 1:
            raise ConfigError(f"{name}={value} must be at least 1")
    per_step = cluster.nproc * trainer.micro_batch_size
    if trainer.global_batch_size % per_step:
        raise ConfigError(
            f"trainer.global_batch_size={trainer.global_batch_size} is not divisible by cluster.nproc "
            f"({cluster.nproc}) x trainer.micro_batch_size ({trainer.micro_batch_size}) = {per_step}; "
            "change one of them so every worker gets whole micro-batches"
        )
    if trainer.precision not in VALID_PRECISIONS:
        raise ConfigError(f"trainer.precision={trainer.precision!r}: choose one of {list(VALID_PRECISIONS)}")
    if cluster.backend not in VALID_BACKENDS:
        raise ConfigError(f"cluster.backend={cluster.backend!r}: choose one of {list(VALID_BACKENDS)}")
    if cluster.backend == "nccl" and not is_scheduled(cluster.kind) and not _cuda_available():
        raise ConfigError("cluster.backend=nccl needs CUDA, which this machine lacks; use cluster.backend=gloo")
    if job.trainer.compile and not any(map(shutil.which, ("cc", "gcc", "c++"))):
        raise ConfigError(
            "trainer.compile=true needs a C compiler for torch.compile's kernels (inductor; Triton's launchers on a "
            "GPU), and none is on PATH: install gcc, or set trainer.compile=false"
        )
    if cluster.threads_per_worker < 0:
        raise ConfigError(f"cluster.threads_per_worker={cluster.threads_per_worker} must be 0 (auto) or more")
    validate_optim(job.optim)
    validate_task(job)
    validate_parallel(job)
    if cluster.collective_timeout_s <= 0 or cluster.start_timeout_s <= 0:
        raise ConfigError("cluster.collective_timeout_s and cluster.start_timeout_s must be positive")
    validate_fault_tolerance(job)
    validate_logging(job.logging)
    if job.resume is not None and not checkpoint_dirs(Path(job.resume) / "checkpoints"):
        raise ConfigError(
            f"resume={job.resume}: no disk checkpoint there (checkpoints/step_N/); resume needs a run that had "
            "ft.checkpoint_every set"
        )


def validate_logging(logging: LoggingConfig) -> None:
    """The chart backends asked for are installed here (they are imported only once the job runs) and W&B's mode is
    one it has."""
    for package, enabled in (("tensorboard", logging.tensorboard), ("wandb", logging.wandb)):
        if enabled and importlib.util.find_spec(package) is None:
            raise ConfigError(
                f"logging.{package}=true needs the {package} package, which this Python lacks: pip install {package} "
                f"(or set logging.{package}=false)"
            )
    if logging.wandb_mode not in VALID_WANDB_MODES:
        raise ConfigError(
            f"logging.wandb_mode={logging.wandb_mode!r}: choose offline (no network; upload later with wandb sync) "
            "or online"
        )


def validate_task(job: JobConfig) -> None:
    """The task against its data (text to pretrain on, conversations to fine-tune on) and LoRA's settings."""
    try:
        check_data_config(job.data, task=job.task.kind)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    if job.task.kind != "lora":
        return
    lora = job.lora
    if lora.rank < 1 or lora.alpha <= 0 or not 0 <= lora.dropout < 1:
        raise ConfigError(
            f"lora.rank={lora.rank} must be at least 1, lora.alpha={lora.alpha} positive and "
            f"lora.dropout={lora.dropout} in [0, 1)"
        )


def validate_parallel(job: JobConfig) -> None:
    """The layout: `cluster.nproc` = `parallel.shard` x `parallel.replicate` (replicate derived when null)."""
    parallel, nproc = job.parallel, job.cluster.nproc
    if parallel.shard < 1:
        raise ConfigError(f"parallel.shard={parallel.shard} must be at least 1 (1: full replicas on every rank)")
    if nproc % parallel.shard:
        raise ConfigError(
            f"parallel.shard={parallel.shard} does not divide cluster.nproc={nproc}: the ranks must form whole "
            "replica groups; choose a shard count that divides cluster.nproc"
        )
    if parallel.replicate is None:
        parallel.replicate = nproc // parallel.shard
    elif parallel.shard * parallel.replicate != nproc:
        raise ConfigError(
            f"parallel.shard={parallel.shard} x parallel.replicate={parallel.replicate} = "
            f"{parallel.shard * parallel.replicate}, but cluster.nproc={nproc}; set parallel.replicate=null to "
            "derive it, or change cluster.nproc"
        )


def validate_optim(optim: OptimConfig) -> None:
    """What AdamW and the schedule would refuse (or silently mistrain with) in every worker, refused here."""
    if not (math.isfinite(optim.lr) and optim.lr > 0):
        raise ConfigError(f"optim.lr={optim.lr} must be a positive learning rate, e.g. optim.lr=3e-4")
    if len(optim.betas) != 2 or not all(0 <= beta < 1 for beta in optim.betas):
        raise ConfigError(
            f"optim.betas={list(optim.betas)} must be two numbers, each in [0, 1), e.g. optim.betas=[0.9,0.95]"
        )
    if not (math.isfinite(optim.eps) and optim.eps > 0):
        raise ConfigError(f"optim.eps={optim.eps} must be positive (it keeps AdamW's division finite), e.g. 1e-8")
    if not (math.isfinite(optim.weight_decay) and optim.weight_decay >= 0):
        raise ConfigError(f"optim.weight_decay={optim.weight_decay} must be 0 (none) or more, e.g. 0.1")
    if not 0 <= optim.min_lr_ratio <= 1:
        raise ConfigError(
            f"optim.min_lr_ratio={optim.min_lr_ratio} must be in [0, 1]: the final learning rate as a fraction "
            "of optim.lr (0: decay to zero, 1: constant after warmup)"
        )
    if optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={optim.warmup_steps} must be 0 (no warmup) or more")


def validate_fault_tolerance(job: JobConfig) -> None:
    ft = job.ft
    if ft.mode not in ("ckptless", "checkpoint_restart", "none"):
        raise ConfigError(f"ft.mode={ft.mode!r}: choose ft=ckptless, ft=checkpoint_restart or ft=none")
    if ft.on_no_spare not in ("shrink", "wait", "fail"):
        raise ConfigError(f"ft.on_no_spare={ft.on_no_spare!r}: choose shrink, wait or fail")
    if ft.on_straggler not in ("replace", "report", "off"):
        raise ConfigError(f"ft.on_straggler={ft.on_straggler!r}: choose replace, report or off")
    if ft.mode != "ckptless" and ft.on_straggler != "off":
        raise ConfigError(
            f"ft.on_straggler={ft.on_straggler} needs ft=ckptless (its coordinator measures each rank's compute); "
            f"ft={ft.mode} takes ft.on_straggler=off"
        )
    if ft.straggler_factor <= 1 or not 1 <= ft.straggler_window_steps <= COMPUTE_KEPT:
        raise ConfigError(
            f"ft.straggler_factor={ft.straggler_factor}, ft.straggler_window_steps={ft.straggler_window_steps}: a "
            f"straggler is more than 1x as slow as the others' median, for 1 to {COMPUTE_KEPT} steps in a row"
        )
    if ft.checkpoint_every != "auto" and not (isinstance(ft.checkpoint_every, int) and ft.checkpoint_every >= 0):
        raise ConfigError(f"ft.checkpoint_every={ft.checkpoint_every!r}: give a number of steps (0: none) or auto")
    if min(ft.spares, ft.max_failures_without_progress, ft.check_every, ft.max_restarts, ft.keep_checkpoints) < 0:
        raise ConfigError(
            "ft.spares, ft.max_failures_without_progress, ft.check_every, ft.max_restarts and ft.keep_checkpoints "
            "must be 0 or more"
        )
    if ft.mtbf_s <= 0:
        raise ConfigError(f"ft.mtbf_s={ft.mtbf_s} must be positive (the job's expected time between failures)")
    if ft.mode == "checkpoint_restart":
        _validate_checkpoint_restart(job)
    if not 0 <= ft.drain_grace_s < ft.drain_timeout_s:
        raise ConfigError(
            f"ft.drain_grace_s={ft.drain_grace_s} must be at least 0 and below ft.drain_timeout_s={ft.drain_timeout_s}:"
            " a leaving host's agent goes at ft.drain_timeout_s, spare or not"
        )
    if ft.lease_s is not None and not 0 < ft.lease_s < ft.host_timeout_s:
        raise ConfigError(
            f"ft.lease_s={ft.lease_s} must be positive and below ft.host_timeout_s={ft.host_timeout_s}: a cut-off host "
            "must fence itself before the coordinator gives its ranks to others (null: 3/4 of ft.host_timeout_s)"
        )
    if min(ft.heartbeat_interval_s, ft.heartbeat_timeout_s, ft.recovery_timeout_s, ft.coordinator_timeout_s) <= 0:
        raise ConfigError(
            "ft.heartbeat_interval_s, ft.heartbeat_timeout_s, ft.recovery_timeout_s and ft.coordinator_timeout_s "
            "must be positive"
        )
    if ft.heartbeat_timeout_s <= 2 * ft.heartbeat_interval_s:
        raise ConfigError("ft.heartbeat_timeout_s must exceed two heartbeat intervals (ft.heartbeat_interval_s)")
    nproc = job.cluster.nproc
    for name, event in _named_fault_events(job):
        try:
            event.check(max_steps=job.trainer.max_steps)
        except ValueError as error:
            raise ConfigError(f"{name}: {error} (trainer.max_steps={job.trainer.max_steps})") from None
        if event.kind in ("kill_host", "partition"):
            _validate_host_fault(job, name, event)
        elif event.kind not in FAULT_KINDS_WITHOUT_RANK and not 0 <= event.rank < nproc:
            raise ConfigError(
                f"{name}.rank={event.rank} is not a rank of this job: cluster.nproc={nproc} has ranks 0..{nproc - 1}; "
                "choose one of them or raise cluster.nproc"
            )


def _validate_host_fault(job: JobConfig, name: str, event: FaultEvent) -> None:
    cluster = job.cluster
    if cluster.kind != "netns":
        what = "powers a host off" if event.kind == "kill_host" else "cuts a host's link"
        raise ConfigError(
            f"{name}: {event.kind} {what}, which only emulated hosts allow: use cluster=netns "
            f"(this run is cluster={cluster.kind})"
        )
    if event.kind == "partition" and job.ft.mode != "ckptless":
        raise ConfigError(f"{name}: a partition is survived by ft=ckptless only (this run is ft={job.ft.mode})")
    if not 0 <= event.host < cluster.num_hosts:
        raise ConfigError(
            f"{name}.host={event.host} is not a training host: cluster.num_hosts={cluster.num_hosts} has hosts "
            f"0..{cluster.num_hosts - 1}"
        )
    if cluster.num_hosts == 1 and job.ft.mode == "ckptless" and not cluster.spare_hosts:
        raise ConfigError(f"{name}: losing the only training host leaves no rank; add cluster.spare_hosts=1")


def _named_fault_events(job: JobConfig) -> list[tuple[str, FaultEvent]]:
    """The run's fault events (as `FaultConfig.events` lists them), each with the config field that sets it."""
    fault = job.fault
    first = [] if fault.kind == "none" else [("fault", fault)]
    return first + [(f"fault.more[{i}]", event) for i, event in enumerate(fault.more)]


def _validate_checkpoint_restart(job: JobConfig) -> None:
    """The baseline has no spares and no coordinator in the workers' loop: only faults that exist without them."""
    if job.ft.spares:
        raise ConfigError(
            f"ft.spares={job.ft.spares}: hot spares are part of ft=ckptless; ft=checkpoint_restart restarts every "
            "worker instead (set ft.spares=0)"
        )
    if job.ft.checkpoint_every == 0:
        raise ConfigError("ft=checkpoint_restart recovers from disk checkpoints: set ft.checkpoint_every to auto or N")
    if job.cluster.spare_hosts:
        raise ConfigError(
            f"cluster.spare_hosts={job.cluster.spare_hosts}: under ft=checkpoint_restart a lost host is replaced by a "
            "fresh one when it is lost (torchrun's spare nodes, its rendezvous redundancy list, restart the group over "
            "and over while they settle); set cluster.spare_hosts=0"
        )
    allowed = ("kill_worker", "exception", "segfault", "hang", "chaos", "kill_host")
    for event in job.fault.events():
        if event.kind == "kill_coordinator":
            raise ConfigError(
                "fault=kill_coordinator kills the ckptless coordinator, which ft=checkpoint_restart does not run "
                "(torchrun's rendezvous is its control plane): use ft=ckptless"
            )
        if event.kind not in allowed:
            raise ConfigError(
                f"fault kind {event.kind!r} needs spares or a recovery in progress, which ft=checkpoint_restart does "
                f"not have; choose one of {list(allowed)}"
            )


def available_options() -> dict[str, list[str]]:
    """Config groups and their options, read from the packaged config tree (for `--help`)."""
    root = resources.files(CONFIG_MODULE)
    return {
        group.name: sorted(p.name.removesuffix(".yaml") for p in group.iterdir() if p.name.endswith(".yaml"))
        for group in sorted(root.iterdir(), key=lambda p: p.name)
        if group.is_dir() and not group.name.startswith("_")
    }


def recipe_launch_line(recipe: str) -> str:
    """The launch command a recipe YAML shows in its first comment (after the `@package` header)."""
    text = (resources.files(CONFIG_MODULE) / "recipe" / f"{recipe}.yaml").read_text()
    comments = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#")]
    return next(c for c in comments if not c.startswith("@"))


def _explain(error: Exception) -> str:
    """An unknown key or option said as such, with what was likely meant; else Hydra's message, plus the underlying
    OmegaConf reason when Hydra wraps one."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, (ConfigAttributeError, ConfigKeyError)) and cause.full_key:
            section, _, name = cause.full_key.rpartition(".")
            siblings = [k.rpartition(".")[2] for k in schema_keys() if k.rpartition(".")[0] == section]
            prefix = f"{section}." if section else ""
            return _unknown(f"key {cause.full_key}", name, siblings, "docs/config.md lists every key", prefix=prefix)
        if isinstance(cause, MissingConfigException) and cause.missing_cfg_file and cause.options:
            group, _, option = str(cause.missing_cfg_file).rpartition("/")
            known = [str(name) for name in cause.options]
            return _unknown(f"{group} option {option!r}", option, known, f"{group} options: {', '.join(known)}")
        cause = cause.__cause__ or cause.__context__
    message = str(error).split("Config search path:")[0].strip()
    cause = error.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in message:
        message = f"{message}\n{str(cause).strip()}"
    return message


def _unknown(what: str, name: str, known: list[str], listing: str, *, prefix: str = "") -> str:
    """`unknown <what>; did you mean <prefix><the closest known name>? (<listing>)`."""
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return f"unknown {what}" + (f"; did you mean {prefix}{close[0]}?" if close else "") + f" ({listing})"


def schema_keys(schema: type = JobConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config (`trainer.max_steps`, ...), as the command line names them."""
    keys = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        key = f"{prefix}{field.name}"
        keys.append(key)
        if dataclasses.is_dataclass(hints[field.name]):
            keys += schema_keys(hints[field.name], prefix=f"{key}.")
    return keys


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
