"""The Slurm test cluster runs real jobs, and Slurm notices a node that loses power."""

from __future__ import annotations

import time

NOT_RESPONDING_TIMEOUT_S = 45.0  # SlurmdTimeout=5 (--quick): sinfo marks it within 10-30 s


def test_runs_a_two_node_job_then_reports_a_powered_off_node(slurm_cluster, tmp_path):
    out = tmp_path / "job.out"
    job = slurm_cluster.run(
        "sbatch",
        "--parsable",
        "--nodes=2",
        "--ntasks-per-node=1",
        f"--output={out}",
        "--wrap=srun hostname",
        cwd=tmp_path,
        timeout_s=60,
    )
    assert job.returncode == 0, job.stderr
    assert slurm_cluster.wait_for_job(job.stdout.strip().split(";")[0], timeout_s=60) == "COMPLETED"
    hostnames = out.read_text().split()
    assert len(set(hostnames)) == 2 and set(hostnames) <= {node.name for node in slurm_cluster.nodes}, hostnames

    victim = slurm_cluster.nodes[-1].name
    slurm_cluster.power_off(victim)
    deadline = time.monotonic() + NOT_RESPONDING_TIMEOUT_S
    states = slurm_cluster.node_states()
    while not (states[victim].endswith("*") or states[victim].startswith("down")) and time.monotonic() < deadline:
        time.sleep(0.5)
        states = slurm_cluster.node_states()
    assert states[victim].endswith("*") or states[victim].startswith("down"), states
    assert all(state == "idle" for name, state in states.items() if name != victim), states
