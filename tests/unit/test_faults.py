"""Fault handlers inside a worker: installed only for the faults a run configures, on signals nothing else sends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from ckptless_core.faults import SIGNALS, FaultEvent, InjectedFault, install_fault_handlers, signal_name

HANDLED = ("exception", "corrupt", "segfault")
WATCHED = (signal.SIGUSR1, signal.SIGUSR2, *(SIGNALS[kind] for kind in HANDLED))


@pytest.fixture
def dispositions():
    """Every watched signal ignored before the test (a known previous disposition), restored after it."""
    original = {signum: signal.signal(signum, signal.SIG_IGN) for signum in WATCHED}
    yield lambda: {signum: signal.getsignal(signum) for signum in WATCHED}
    for signum, handler in original.items():
        signal.signal(signum, handler)


def build_module() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def forward_pre_hooks(module: torch.nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) for m in module.modules())


def test_injected_signals_are_distinct_real_time_signals_the_coordinator_can_name():
    handled = [SIGNALS[kind] for kind in HANDLED]
    assert len(set(handled)) == len(handled)
    assert all(signal.SIGRTMIN < signum < signal.SIGRTMAX for signum in handled)
    assert [signal_name(signum) for signum in handled] == ["SIGRTMIN+1", "SIGRTMIN+2", "SIGRTMIN+3"]


@pytest.mark.parametrize(
    "faults", [[], [FaultEvent(kind="kill_worker"), FaultEvent(kind="hang")]], ids=["none", "external"]
)
def test_without_a_fault_that_needs_one_no_handler_and_no_hook_is_installed(dispositions, faults):
    module = build_module()
    before = dispositions()
    install_fault_handlers(module, faults=faults)
    assert forward_pre_hooks(module) == 0
    assert dispositions() == before


def test_an_exception_fault_installs_only_its_handler_and_raises_in_the_next_forward(dispositions):
    module = build_module()
    before = dispositions()
    install_fault_handlers(module, faults=[FaultEvent(kind="exception")])
    after = dispositions()
    assert [signum for signum in WATCHED if after[signum] != before[signum]] == [SIGNALS["exception"]]
    assert forward_pre_hooks(module) == 1
    inputs = torch.ones(3, 4)
    module(inputs)  # no signal yet: the hook lets the forward through
    os.kill(os.getpid(), SIGNALS["exception"])
    with pytest.raises(InjectedFault):
        module(inputs)
    module(inputs)  # one signal, one error


def test_a_corrupt_fault_perturbs_one_parameter_and_registers_no_hook(dispositions):
    module = build_module()
    original = [p.detach().clone() for p in module.parameters()]
    install_fault_handlers(module, faults=[FaultEvent(kind="corrupt")])
    assert forward_pre_hooks(module) == 0
    os.kill(os.getpid(), SIGNALS["corrupt"])
    changed = [(p - o).abs().sum().item() for p, o in zip(module.parameters(), original, strict=True)]
    assert changed == pytest.approx([1.0] + [0.0] * (len(changed) - 1))


SEGFAULT_SCRIPT = """
import os, torch
from ckptless_core.faults import SIGNALS, FaultEvent, install_fault_handlers
module = torch.nn.Linear(4, 2)
install_fault_handlers(module, faults=[FaultEvent(kind="segfault")])
module(torch.ones(1, 4))
print("first forward done", flush=True)
os.kill(os.getpid(), SIGNALS["segfault"])
print("signal handled", flush=True)
module(torch.ones(1, 4))
print("survived", flush=True)
"""


def test_a_segfault_fault_crashes_the_process_natively_at_the_next_forward():
    proc = subprocess.run([sys.executable, "-c", SEGFAULT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGSEGV, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == ["first forward done", "signal handled"]
    assert "Traceback" not in proc.stderr  # a native crash, not a Python exception
