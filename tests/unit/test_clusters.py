"""Cluster kinds: the lookup, each kind's own refusals, and the dry run's worker lines saying where workers really run
(the c10d store's address, each host's ranks, the agent command). A dry run builds nothing: composed jobs only."""

import shlex

import pytest

from ckptless_core.dist import WorkerEnv
from launcher.clusters import KINDS, cluster_kind
from launcher.clusters import netns as netns_kind
from launcher.compose import available_options, compose_job
from launcher.errors import ConfigError
from launcher.run import worker_lines

TINY = ["recipe=tiny_llama", "trainer.micro_batch_size=4", "dry_run=true"]


@pytest.fixture
def emulated_hosts_allowed(monkeypatch):
    """`cluster=netns` composes without root here: its dry run makes no namespace."""
    monkeypatch.setattr(netns_kind, "check_netns_available", lambda: None)


def workers_of(lines: list[str]) -> list[dict[str, str]]:
    """The environment of each worker line (comments skipped), in order; the argv checked on the way."""
    envs = []
    for line in lines:
        if line.startswith("#") or "python -m recipes.train" not in line:
            continue
        words = shlex.split(line)
        env = {}
        while "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
            key, value = words.pop(0).split("=", 1)
            env[key] = value
        assert words[:3] == ["python", "-m", "recipes.train"]
        envs.append(env)
    return envs


def test_every_packaged_cluster_option_is_a_known_kind():
    for option in available_options()["cluster"]:
        assert option in KINDS
    with pytest.raises(
        ConfigError, match=r"cluster.kind='moon': choose one of \['local', 'netns', 'hosts', 'slurm', 'k8s'\]"
    ):
        cluster_kind("moon")


def test_local_workers_reach_the_store_on_loopback(tmp_path):
    job = compose_job([*TINY, "cluster.nproc=4"]).job
    workers = workers_of(worker_lines(job, run_dir=tmp_path))
    assert [(w["RANK"], w["LOCAL_RANK"], w["MASTER_ADDR"]) for w in workers] == [
        (str(r), str(r), "127.0.0.1") for r in range(4)
    ]


def test_hosts_workers_reach_the_store_at_the_coordinators_address_and_each_host_runs_the_agent(tmp_path):
    job = compose_job([*TINY, "cluster=hosts", "cluster.coordinator_address=10.0.0.1", "cluster.nproc_per_host=2"]).job
    lines = worker_lines(job, run_dir=tmp_path)

    assert "127.0.0.1" not in "\n".join(lines)
    agent = [line for line in lines if line.startswith("python -m ckptless_core.agent")]
    assert len(agent) == 1
    argv = shlex.split(agent[0].replace("[--ifname <interface>]", ""))
    assert argv[argv.index("--coordinator") + 1] == "10.0.0.1:<port>"
    assert argv[argv.index("--secret-file") + 1] == str(tmp_path / "control.secret")
    assert argv[argv.index("--run-dir") + 1] == str(tmp_path)
    workers = workers_of(lines)
    # 2 hosts x 2 workers: consecutive ranks per host, LOCAL_RANK the worker's slot on its host.
    assert [(w["RANK"], w["LOCAL_RANK"], w["WORLD_SIZE"]) for w in workers] == [
        ("0", "0", "4"),
        ("1", "1", "4"),
        ("2", "0", "4"),
        ("3", "1", "4"),
    ]
    assert {w["MASTER_ADDR"] for w in workers} == {"10.0.0.1"}


def test_in_a_run_on_hosts_the_agent_command_is_left_to_the_coordinator_which_knows_its_port(tmp_path):
    job = compose_job([*TINY, "dry_run=false", "cluster=hosts", "cluster.coordinator_address=10.0.0.1"]).job
    lines = worker_lines(job, run_dir=tmp_path)
    assert "--coordinator" not in "\n".join(lines)
    assert lines[0].endswith("(the command is printed below once the coordinator listens)")
    assert [w["MASTER_ADDR"] for w in workers_of(lines)] == ["10.0.0.1", "10.0.0.1"]


def test_hosts_dry_run_names_a_fixed_coordinator_port(tmp_path):
    job = compose_job(
        [*TINY, "cluster=hosts", "cluster.coordinator_address=10.0.0.1", "cluster.coordinator_port=29400"]
    )
    assert any("--coordinator 10.0.0.1:29400 " in line for line in worker_lines(job.job, run_dir=tmp_path))


def test_netns_workers_run_on_the_emulated_hosts(emulated_hosts_allowed, tmp_path, monkeypatch):
    job = compose_job([*TINY, "cluster=netns", "cluster.num_hosts=2", "cluster.nproc_per_host=2"]).job
    lines = worker_lines(job, run_dir=tmp_path)

    hosts = [line for line in lines if line.startswith("# host")]
    assert hosts[:2] == ["# host0 (10.213.K.10)", "# host1 (10.213.K.11)"]
    assert len(hosts) == 3 and hosts[2].startswith("# host2 (10.213.K.12): a spare host")  # netns.yaml: one
    workers = workers_of(lines)
    assert [(w["RANK"], w["LOCAL_RANK"]) for w in workers] == [("0", "0"), ("1", "1"), ("2", "0"), ("3", "1")]
    assert {(w["MASTER_ADDR"], w["GLOO_SOCKET_IFNAME"]) for w in workers} == {("10.213.K.1", "eth0")}
    # What the worker reads is what torchrun would set, the store's port aside.
    for key, value in {**workers[3], "MASTER_PORT": "29512"}.items():
        monkeypatch.setenv(key, value)
    worker = WorkerEnv.from_environ()
    assert (worker.rank, worker.local_rank, worker.world_size, worker.master_addr) == (3, 1, 4, "10.213.K.1")


def test_the_baseline_runs_one_torchrun_locally_and_one_per_emulated_host(emulated_hosts_allowed, tmp_path):
    baseline = ["ft=checkpoint_restart", "ft.spares=0"]
    (local,) = worker_lines(compose_job([*TINY, *baseline]).job, run_dir=tmp_path)
    assert "torch.distributed.run --standalone --nproc-per-node=2 " in local

    job = compose_job([*TINY, *baseline, "cluster=netns", "cluster.spare_hosts=0"]).job
    torchruns = [line for line in worker_lines(job, run_dir=tmp_path) if "torch.distributed.run" in line]
    assert len(torchruns) == 2
    for i, line in enumerate(torchruns):
        argv = shlex.split(line)
        assert f"--local-addr=10.213.K.{10 + i}" in argv
        assert "--rdzv-endpoint=10.213.K.1:$RDZV_PORT" in argv
        assert f"--log-dir={tmp_path}/logs/torchrun/host{i}" in argv
        assert "GLOO_SOCKET_IFNAME=eth0" in argv


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["cluster.num_hosts=2"], "cluster=local is one host"),
        (["cluster.spare_hosts=1"], "cluster=local is one host"),
        (["cluster=hosts", "ft=checkpoint_restart"], "start torchrun on each host yourself"),
    ],
)
def test_each_kind_refuses_what_it_cannot_run(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose_job([*TINY, *overrides])


def test_a_hosts_dry_run_from_the_command_line_prints_where_workers_run(launch, tmp_path):
    proc = launch(
        *TINY, "cluster=hosts", "cluster.coordinator_address=10.0.0.1", "dry_run=true", f"run.dir={tmp_path / 'run'}"
    )
    assert proc.returncode == 0, proc.stderr
    workers = proc.stdout.split("     workers\n", 1)[1]
    assert "127.0.0.1" not in workers
    assert workers.count("MASTER_ADDR=10.0.0.1 ") == workers.count("python -m recipes.train") == 2
    assert "python -m ckptless_core.agent --coordinator 10.0.0.1:<port> " in workers
    assert not (tmp_path / "run").exists()
