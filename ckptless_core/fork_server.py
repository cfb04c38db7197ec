"""Imported first by the fork server (as a preload module): it ignores SIGTERM and SIGINT.

A preemption or Ctrl-C often reaches every process of the job at once. The coordinator alone decides how workers
stop (cleanly at a step boundary, or killed), so the fork server, and the workers it forks, which inherit this,
must survive those signals: a dead fork server would also lose its workers' exit codes.
"""

import signal

signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
