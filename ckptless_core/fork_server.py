"""Imported first by the fork server (as a preload module): it ignores SIGTERM and SIGINT, and exits fast.

A preemption or Ctrl-C often reaches every process of the job at once. The coordinator alone decides how workers
stop (cleanly at a step boundary, or killed), so the fork server, and the workers it forks, which inherit this,
must survive those signals: a dead fork server would also lose its workers' exit codes.

A fork server ends when its job does; the interpreter's last collection of every object it imported (torch,
transformers) would then cost it seconds of CPU after the job, which the next job on the host pays for. Freezing
them as its last exit step skips that (its forked workers leave with `os._exit` and never run it).
"""

import atexit
import gc
import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
atexit.register(gc.freeze)  # registered first: runs last, after every other exit handler
