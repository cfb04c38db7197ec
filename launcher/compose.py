"""Composing the Hydra config tree into a typed, validated `JobConfig` (the only place that runs Hydra)."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from hydra import compose, initialize_config_module
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import OmegaConf, open_dict, read_write
from omegaconf.errors import OmegaConfBaseException

from launcher.errors import ConfigError
from recipes.schema import JobConfig

CONFIG_MODULE = "configs"
VALID_PRECISIONS = ("fp32", "bf16")
VALID_BACKENDS = ("auto", "gloo", "nccl")


@dataclass(frozen=True)
class ComposedJob:
    job: JobConfig
    """The typed, validated configuration."""
    recipe: str
    """The recipe option chosen (`tiny_llama`, ...)."""
    yaml: str
    """The composed config as YAML (what `--cfg job` prints)."""


def compose_job(overrides: list[str]) -> ComposedJob:
    """Compose `configs/config.yaml` with command-line overrides; unknown keys and wrong types are refused."""
    ConfigStore.instance().store(name="job_schema", node=JobConfig)
    try:
        with initialize_config_module(config_module=CONFIG_MODULE, version_base="1.3"):
            cfg = compose("config", overrides=overrides, return_hydra_config=True)
        recipe = str(cfg.hydra.runtime.choices.recipe)
        with read_write(cfg), open_dict(cfg):
            del cfg["hydra"]
        # Re-merging into the schema refuses keys that `+key=value` overrides slipped past struct mode.
        job = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(JobConfig), OmegaConf.to_container(cfg)))
    except (HydraException, OmegaConfBaseException) as error:
        raise ConfigError(_explain(error)) from None
    validate(job)
    return ComposedJob(job=job, recipe=recipe, yaml=OmegaConf.to_yaml(cfg))


def validate(job: JobConfig) -> None:
    """Checks across fields that types alone cannot express; each message names the field and a fix."""
    trainer, cluster = job.trainer, job.cluster
    if cluster.kind != "local":
        raise ConfigError(
            f"cluster.kind={cluster.kind!r} is not available yet: this version runs cluster=local only "
            "(Slurm, Kubernetes and multi-node clusters come later)"
        )
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
    if cluster.backend == "nccl" and not _cuda_available():
        raise ConfigError("cluster.backend=nccl needs CUDA, which this machine lacks; use cluster.backend=gloo")
    if cluster.threads_per_worker < 0:
        raise ConfigError(f"cluster.threads_per_worker={cluster.threads_per_worker} must be 0 (auto) or more")
    if job.optim.warmup_steps < 0 or len(job.optim.betas) != 2:
        raise ConfigError("optim.warmup_steps must be >= 0 and optim.betas a list of two numbers")
    if cluster.collective_timeout_s <= 0 or cluster.start_timeout_s <= 0:
        raise ConfigError("cluster.collective_timeout_s and cluster.start_timeout_s must be positive")
    validate_fault_tolerance(job)
    if job.resume is not None and not list((Path(job.resume) / "checkpoints").glob("step_*.safetensors")):
        raise ConfigError(
            f"resume={job.resume}: no disk checkpoint there (checkpoints/step_*.safetensors); resume needs a run "
            "that had ft.checkpoint_every set"
        )


def validate_fault_tolerance(job: JobConfig) -> None:
    ft = job.ft
    if ft.mode not in ("ckptless", "checkpoint_restart", "none"):
        raise ConfigError(f"ft.mode={ft.mode!r}: choose ft=ckptless, ft=checkpoint_restart or ft=none")
    if ft.on_no_spare not in ("shrink", "wait", "fail"):
        raise ConfigError(f"ft.on_no_spare={ft.on_no_spare!r}: choose shrink, wait or fail")
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
    if min(ft.heartbeat_interval_s, ft.heartbeat_timeout_s, ft.recovery_timeout_s) <= 0:
        raise ConfigError("ft.heartbeat_interval_s, ft.heartbeat_timeout_s and ft.recovery_timeout_s must be positive")
    if ft.heartbeat_timeout_s <= 2 * ft.heartbeat_interval_s:
        raise ConfigError("ft.heartbeat_timeout_s must exceed two heartbeat intervals (ft.heartbeat_interval_s)")
    for event in job.fault.events():
        try:
            event.check(max_steps=job.trainer.max_steps)
        except ValueError as error:
            raise ConfigError(f"fault: {error} (trainer.max_steps={job.trainer.max_steps})") from None
        if event.kind not in ("chaos", "kill_sender", "kill_spare") and not 0 <= event.rank < job.cluster.nproc:
            raise ConfigError(f"fault.rank={event.rank} is not a rank of this job (cluster.nproc={job.cluster.nproc})")


def _validate_checkpoint_restart(job: JobConfig) -> None:
    """The baseline has no spares and no supervisor in the workers' loop: only faults that exist without them."""
    if job.ft.spares:
        raise ConfigError(
            f"ft.spares={job.ft.spares}: hot spares are part of ft=ckptless; ft=checkpoint_restart restarts every "
            "worker instead (set ft.spares=0)"
        )
    if job.ft.checkpoint_every == 0:
        raise ConfigError("ft=checkpoint_restart recovers from disk checkpoints: set ft.checkpoint_every to auto or N")
    allowed = ("kill_worker", "exception", "hang", "chaos")
    for event in job.fault.events():
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
    """Hydra's message, plus the underlying OmegaConf reason when Hydra wraps one."""
    message = str(error).split("Config search path:")[0].strip()
    cause = error.__cause__
    if cause is not None and str(cause).strip() and str(cause).strip() not in message:
        message = f"{message}\n{str(cause).strip()}"
    return message


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()
