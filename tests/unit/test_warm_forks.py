"""The warm fork server: processes forked from a process's own imports report their exit codes as multiprocessing
does, inherit none of its files, and the server ends with the agent's end of its socket."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import json, os, signal, sys, time
from ckptless_core.warm_forks import WarmForks, can_fork_here, start_warm_fork_server


def exits(code):
    sys.exit(code)


def raises():
    raise ValueError("a bug in the worker")


def sleeps():
    time.sleep(60)


def lists_files(path):
    files = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
    with open(path, "w") as out:
        json.dump(files, out)


def started(target, **kwargs):
    process = forks.Process(target=target, kwargs=kwargs, name=target.__name__)
    process.start()
    return process


assert can_fork_here()
kept_open = os.dup2(os.open(os.devnull, os.O_RDONLY), 50)  # a file of the launcher's: no worker inherits it
server, agent_end = start_warm_fork_server(["json", "no_such_module"])
forks = WarmForks(agent_end)
results = {}
for name, process in {"exits": started(exits, code=3), "raises": started(raises)}.items():
    process.join(timeout=30)
    results[name] = process.exitcode
sleeper = started(sleeps)
sleeper.join(timeout=0.2)
results["alive"] = sleeper.exitcode is None
os.kill(sleeper.pid, signal.SIGKILL)
sleeper.join(timeout=30)
results["killed"] = sleeper.exitcode
listing = started(lists_files, path=sys.argv[1])
listing.join(timeout=30)
results["files"] = json.load(open(sys.argv[1]))
results["kept_open"] = kept_open
agent_end.close()  # the agent is gone: so is the server
os.waitpid(server, 0)
results["server_ended"] = True
print(json.dumps(results))
"""


def test_forked_processes_report_exits_as_multiprocessing_does_inherit_no_file_and_the_server_ends_with_the_agent(
    tmp_path,
):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "files.json")], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    results = __import__("json").loads(proc.stdout.splitlines()[-1])
    assert results["exits"] == 3 and results["raises"] == 1 and "ValueError: a bug in the worker" in proc.stderr
    assert results["alive"] and results["killed"] == -9
    # Standard streams, and the descriptor that listed them: not the launcher's file, nor the server's socket.
    assert results["files"] == [0, 1, 2, 3], results
    assert results["server_ended"]
