"""The ckptless launcher: `python -m launcher recipe=<name> [overrides]`."""

import time

PROCESS_STARTED_AT = time.time()
"""When the launcher process began, before its heavy imports: `wall_s` in summary.json counts from here."""
