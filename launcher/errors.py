"""The launcher's exit codes and its error for bad input."""

EXIT_OK = 0
"""The job completed."""
EXIT_INTERNAL = 1
"""A bug in ckptless itself (Python's default for an uncaught exception)."""
EXIT_BAD_INPUT = 2
"""Bad input: the config, its values, data paths, the run directory, or a model too large; nothing was started."""
EXIT_JOB_FAILED = 3
"""The job started and failed while running (a worker died or raised); see summary.json and logs/."""
EXIT_NO_PROGRESS = 4
"""Repeated failures without a committed step in between (`ft.max_failures_without_progress`): the job gave up."""
EXIT_TRAINING_CODE_ERROR = 5
"""The training code raised the same error again after a replay of the step: a bug, not a failure (traceback shown)."""
EXIT_INTERRUPTED = 130
"""Stopped by Ctrl-C or SIGTERM."""


class ConfigError(ValueError):
    """Bad input a user can fix; the message says what was wrong and how to fix it."""
