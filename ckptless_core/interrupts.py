"""What interrupts a worker's step: the errors that send it into recovery or end it, told apart by type, and the
hooks that stop a step's compute as soon as a new generation exists.

Recovery catches what it can recover from by type (`failure_cause`): a failed collective (`PeerFailure`) or a new
generation (`GenerationChanged`) is a failure elsewhere; any other error raised by the training code is replayed once,
then ends the job as a `TrainingCodeError`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PeerFailure(RuntimeError):
    """A collective failed: some peer died, hung or left. Survivors recover; they never exit."""


class GenerationChanged(RuntimeError):
    """The coordinator started a new generation (a failure elsewhere, or a spare joining)."""


class ReplicaDivergence(RuntimeError):
    """The replicas' state checksums disagree: silent corruption or divergence, repaired from the majority."""


class TrainingCodeError(RuntimeError):
    """The training step raised the same error again when it was replayed: a bug, not a failure. The job ends; no
    spare is spent on it."""


class StopRequested(Exception):
    """The coordinator asked for a clean stop at a step boundary (preemption: SIGTERM to the launcher)."""


class HandedOver(SystemExit):
    """This worker handed its rank over in a planned move (its host drained, or it straggled) and leaves the job.
    A SystemExit with status 0: a training script's loop ends there, and its process exits cleanly."""

    def __init__(self, message: str) -> None:
        super().__init__(0)
        self.message = message


def failure_cause(error: Exception) -> str:
    """How a failure that interrupted a step is recorded (`failure_noticed`'s `cause`): `generation_changed`,
    `peer_failure`, or `local_error` (raised by the training code itself)."""
    if isinstance(error, GenerationChanged):
        return "generation_changed"
    return "peer_failure" if isinstance(error, PeerFailure) else "local_error"


def interrupt_compute(module: torch.nn.Module, check: Callable[[], None]) -> None:
    """Call `check` (which raises to interrupt) before the forward of every submodule of `module` and as the gradient
    of every trainable parameter is computed: a step's forward and backward passes stop at the next module or
    gradient. Never the optimizer update: it must not be cut (critical section)."""

    def hook(*_) -> None:
        check()

    for submodule in module.modules():
        submodule.register_forward_pre_hook(hook)
    for parameter in module.parameters():
        if parameter.requires_grad:
            parameter.register_hook(hook)
