"""`cluster=k8s`: the job as a JobSet (sigs.k8s.io/jobset, `jobset.x-k8s.io/v1alpha2`) and the three core objects
it needs, rendered for `kubectl apply`; the launcher itself talks to no cluster (`submit` writes the manifests into
`<run dir>/k8s/`, the dry run prints them).

What the manifests hold (`manifests`), in the order they are applied:
- a Secret: the job's secret, mounted into every pod as a file (`--secret-file`);
- a ConfigMap: the resolved config, which the coordinator copies into the run directory on its first start;
- a headless Service `<name>-coordinator`: the coordinator's stable DNS name, `<name>-coordinator.<namespace>.svc`,
  which follows its pod wherever Kubernetes starts it again (agents read it from `coordinator/address`);
- the JobSet: replicated job `coordinator` (one pod, `python -m launcher.coordinate`, its journal in the run
  directory on the ReadWriteMany volume `cluster.volume`) and replicated job `agents` (one Job of one pod per host,
  `num_hosts + spare_hosts` of them, `python -m ckptless_core.agent`).

Failures. An agent's pod that ends for any reason but success fails its Job (`backoffLimit: 0`), and the JobSet
recreates that Job alone (`RestartJobAndIgnoreMaxRestarts`: JobSet v0.12.0 or later, with its `RestartJob` feature
gate on): a fresh pod joins as a fresh spare host (the agent names itself `<hostname>-<n>`, n new at every start);
the other hosts go on. The coordinator's exit with the job's own outcome (a failure: 2-5; stopped by SIGTERM: 130)
fails its Job and so the JobSet (`FailJobSet`); its exit 0 completes the JobSet (`successPolicy`). Any other end of
its pod is replaced by its own Job: a pod Kubernetes took away (a lost node: `DisruptionTarget`) not counted, a crash
counted up to `COORDINATOR_BACKOFF_LIMIT`; the new coordinator resumes from its journal, under the same DNS name.
Every replicated job has its rule: a failure no rule matches would recreate the whole JobSet.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import os
import re
from pathlib import Path, PurePosixPath

import yaml
from omegaconf import OmegaConf

from ckptless_core.channel import new_secret
from ckptless_core.coordinator_process import CoordinatorProcess
from launcher.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERRUPTED,
    EXIT_JOB_FAILED,
    EXIT_NO_PROGRESS,
    EXIT_TRAINING_CODE_ERROR,
    ConfigError,
)
from launcher.torchrun import TorchrunJob
from recipes.schema import ClusterConfig, JobConfig
from recipes.train import worker_preload

OPTIONS: tuple[str, ...] = ("ifname", "image", "namespace", "volume", "mount_path", "node_selector", "tolerations")
"""The `cluster.*` options only this kind reads (others refuse them when set)."""
COORDINATOR_TIMEOUT_S = 600.0
"""`ft.coordinator_timeout_s` by default: a coordinator pod on an unreachable node is evicted only after the
default 300 s toleration, then recreated elsewhere."""
DEFAULT_PORT = 29400
"""The coordinator's control port when `cluster.coordinator_port` is 0 (a pod has its own address: no clash)."""
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
JOBSET_RELEASE = "v0.12.0"
"""The first JobSet release with the `RestartJob` and `RestartJobAndIgnoreMaxRestarts` actions (behind its alpha
`RestartJob` feature gate, off by default there: docs/kubernetes.md says how to turn it on)."""
MANIFESTS_DIR = "k8s"
"""In the run directory: one file per document, numbered in the order `kubectl apply -f` takes them."""
MANIFEST_FILES = ("00-secret.yaml", "01-configmap.yaml", "02-service.yaml", "03-jobset.yaml")
CONFIG_DIR = PurePosixPath("/etc/ckptless")
"""In every pod: `config.yaml` (from the ConfigMap) and `control.secret` (from the Secret), one projected volume."""
SECRET_KEY = "control.secret"
CONFIG_KEY = "config.yaml"
SECRET_PLACEHOLDER = b"placeholder: the job's secret is made fresh when the job is submitted\n"
"""What the dry run shows instead of a secret (not hex: a pod given it refuses to start)."""
JOB_OUTCOME_EXIT_CODES = (EXIT_BAD_INPUT, EXIT_JOB_FAILED, EXIT_NO_PROGRESS, EXIT_TRAINING_CODE_ERROR, EXIT_INTERRUPTED)
"""The coordinator's exit codes that are the job's own outcome, not a crash: starting it again would not help."""
COORDINATOR_BACKOFF_LIMIT = 6
"""Coordinator crashes (an exit not in `JOB_OUTCOME_EXIT_CODES`, a kill for memory) its Job replaces before the
JobSet fails; pods Kubernetes takes away do not count."""
MAX_HOSTS = 1024
"""JobSet refuses more replicas of a replicated job under a `RestartJob` action."""
NAME_MAX = 40
"""Longest JobSet name: its Jobs (`<name>-coordinator-0`), pods' hostnames and the Service stay DNS labels (63)."""
TOLERATION_KEYS = ("key", "operator", "value", "effect", "tolerationSeconds")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check(job: JobConfig) -> None:
    """What the manifests could not express or the pods could not run, refused with the option to change."""
    cluster = job.cluster
    if job.ft.mode == "checkpoint_restart":
        raise ConfigError(
            "ft=checkpoint_restart runs torchrun, which cluster=k8s does not place (a lost pod would restart every "
            "host); use ft=ckptless, or ft=checkpoint_restart on cluster=local or cluster=netns"
        )
    if cluster.coordinator_address != ClusterConfig().coordinator_address:
        raise ConfigError(
            "cluster.coordinator_address is cluster=hosts's: on cluster=k8s the coordinator is found by its "
            "Service's DNS name; remove it"
        )
    if not _DNS_LABEL.match(cluster.namespace) or len(cluster.namespace) > 63:
        raise ConfigError(f"cluster.namespace={cluster.namespace!r} is not a Kubernetes namespace name")
    if not _DNS_SUBDOMAIN.match(cluster.volume) or len(cluster.volume) > 253:
        raise ConfigError(f"cluster.volume={cluster.volume!r} is not a PersistentVolumeClaim name")
    if not cluster.image.strip():
        raise ConfigError("cluster.image is empty: give the container image the pods run (ckptless installed)")
    if not cluster.mount_path.startswith("/") or cluster.mount_path.rstrip("/") in ("", str(CONFIG_DIR)):
        raise ConfigError(
            f"cluster.mount_path={cluster.mount_path!r}: give an absolute path in the pods for the volume, "
            f"other than / and {CONFIG_DIR}"
        )
    if not 0 <= cluster.coordinator_port <= 65535:
        raise ConfigError(f"cluster.coordinator_port={cluster.coordinator_port}: give a port (0: {DEFAULT_PORT})")
    if cluster.num_hosts + cluster.spare_hosts > MAX_HOSTS:
        raise ConfigError(
            f"cluster.num_hosts + cluster.spare_hosts = {cluster.num_hosts + cluster.spare_hosts}: a JobSet "
            f"recreates single hosts' Jobs for at most {MAX_HOSTS}"
        )
    for i, toleration in enumerate(cluster.tolerations):
        unknown = sorted(set(toleration) - set(TOLERATION_KEYS))
        if unknown:
            raise ConfigError(f"cluster.tolerations[{i}] has {unknown}: a toleration has only {list(TOLERATION_KEYS)}")
    if job.resume is not None and not _is_under(job.resume, cluster.mount_path):
        raise ConfigError(
            f"resume={job.resume}: on cluster=k8s give the earlier run's directory as the pods see it, under "
            f"cluster.mount_path={cluster.mount_path} (this machine must see it there too: mount the volume there)"
        )


def check_submission(job: JobConfig) -> None:
    """Nothing to check here: submitting writes manifests; `kubectl apply` is the user's, and the cluster checks
    them then."""


def warm_up(job: JobConfig) -> None:
    """Nothing: the job runs where Kubernetes places its pods."""
    return None


def coordinator(job: JobConfig, *, run_dir: Path, warm: CoordinatorProcess | None) -> CoordinatorProcess:
    raise ConfigError("cluster=k8s is submitted (`submit`); its coordinator runs in the JobSet's coordinator pod")


def torchrun(job: JobConfig, *, run_dir: Path, threads_per_worker: int) -> TorchrunJob:
    raise ConfigError("ft=checkpoint_restart does not run on cluster=k8s")  # (`check` refused it already)


def torchrun_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    raise ConfigError("ft=checkpoint_restart does not run on cluster=k8s")  # (`check` refused it already)


def while_running(job: JobConfig, *, run_dir: Path) -> None:
    """In the coordinator's pod, while the job runs: nothing to do (the JobSet recreates a lost host's Job itself)."""


def release(run_dir: Path) -> None:
    """The job ended: nothing to release (the JobSet's success or failure policy ends the agents' pods)."""


def worker_lines(job: JobConfig, *, run_dir: Path) -> list[str]:
    """Where the pods run. The dry run shows the manifests `submit` would write, as one multi-document YAML (a
    placeholder for the secret), and writes nothing; a submission writes them, so its plan only names them."""
    cluster = job.cluster
    header = [
        f"# JobSet {jobset_name(run_dir)} (namespace {cluster.namespace}): a coordinator pod and "
        f"{cluster.num_hosts + cluster.spare_hosts} agent pods, one per host ({cluster.spare_hosts} spare), image "
        f"{cluster.image}; the pods' run directory is {pods_run_dir(job, run_dir)} on PersistentVolumeClaim "
        f"{cluster.volume}; needs JobSet {JOBSET_RELEASE}+ with feature gate RestartJob",
        f"# the manifests {'a submission writes into' if job.dry_run else 'are written into'} "
        f"{run_dir / MANIFESTS_DIR}/, for `kubectl apply -f {run_dir / MANIFESTS_DIR}`",
    ]
    if not job.dry_run:
        return header
    return header + render(manifests(job, run_dir=run_dir, secret=None)).splitlines()


def submit(job: JobConfig, *, run_dir: Path, recipe: str) -> int:
    """Write the manifests (a fresh secret; its file readable by its owner only) into `<run dir>/k8s/`, say how
    to apply and follow them; 0."""
    folder = run_dir / MANIFESTS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    for filename, document in zip(MANIFEST_FILES, manifests(job, run_dir=run_dir, secret=new_secret()), strict=True):
        path = folder / filename
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as file:
            os.fchmod(file.fileno(), 0o600 if document["kind"] == "Secret" else 0o644)
            file.write(render([document]))
    name, namespace, pods_dir = jobset_name(run_dir), job.cluster.namespace, pods_run_dir(job, run_dir)
    print(
        f"{recipe}: the manifests of JobSet {name} (namespace {namespace}) are in {folder}; submit them with\n"
        f"  kubectl apply -f {folder}\n"
        f"needs: the JobSet controller {JOBSET_RELEASE} or later with its RestartJob feature gate on, and the "
        f"ReadWriteMany PersistentVolumeClaim {job.cluster.volume} in namespace {namespace} (docs/kubernetes.md)\n"
        f"follow: kubectl logs -n {namespace} -f job/{name}-coordinator-0   (progress, recoveries, the outcome)\n"
        f"        kubectl get jobset -n {namespace} {name}   (Completed or Failed at the end)\n"
        f"summary: {pods_dir}/summary.json on the volume, written when the job ends\n"
        f"stop (workers stop together at a step boundary): kubectl delete -f {folder}",
        flush=True,
    )
    return 0


def jobset_name(run_dir: Path) -> str:
    """`ckptless-<run dir name>` as a DNS label (lowercase, `-`), at most `NAME_MAX` characters (a shortened one
    ends with a hash of the whole)."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_dir.name.lower()).strip("-")
    name = f"ckptless-{slug}".rstrip("-")
    if len(name) > NAME_MAX:
        digest = hashlib.sha256(run_dir.name.encode()).hexdigest()[:6]
        name = f"{name[: NAME_MAX - 7].rstrip('-')}-{digest}"
    return name


def pods_run_dir(job: JobConfig, run_dir: Path) -> PurePosixPath:
    """The run directory as the pods see it: `<cluster.mount_path>/<run dir name>` on the volume."""
    return PurePosixPath(job.cluster.mount_path) / run_dir.name


def coordinator_dns_name(job: JobConfig, run_dir: Path) -> str:
    """The headless Service's name, which resolves to the coordinator pod's address wherever it runs."""
    return f"{jobset_name(run_dir)}-coordinator.{job.cluster.namespace}.svc"


def coordinator_port(job: JobConfig) -> int:
    return job.cluster.coordinator_port or DEFAULT_PORT


def coordinator_command(job: JobConfig, run_dir: Path) -> list[str]:
    """What the coordinator's pod runs: it binds every address of the pod and tells agents the Service's name."""
    return [
        "python",
        "-m",
        "launcher.coordinate",
        str(pods_run_dir(job, run_dir)),
        "--config",
        str(CONFIG_DIR / CONFIG_KEY),
        "--secret-file",
        str(CONFIG_DIR / SECRET_KEY),
        "--bind",
        "0.0.0.0",
        "--port",
        str(coordinator_port(job)),
        "--advertise",
        coordinator_dns_name(job, run_dir),
    ]


def agent_command(job: JobConfig, run_dir: Path) -> list[str]:
    """What each agent's pod runs. It waits for a coordinator as long as a running agent would for a lost one
    (`ft.coordinator_timeout_s`): a pod recreated while the coordinator's is too would otherwise give up first."""
    run = pods_run_dir(job, run_dir)
    ifname = ["--ifname", job.cluster.ifname] if job.cluster.ifname else []
    return [
        "python",
        "-m",
        "ckptless_core.agent",
        "--coordinator-file",
        str(run / "coordinator" / "address"),
        "--secret-file",
        str(CONFIG_DIR / SECRET_KEY),
        "--run-dir",
        str(run),
        *ifname,
        "--connect-timeout-s",
        f"{job.ft.coordinator_timeout_s:g}",
        "--preload",
        *worker_preload(job),
    ]


def slots_per_host(job: JobConfig) -> int:
    """Worker processes one host may hold: its training ranks and the spare workers placed beside them (the
    coordinator deals `ft.spares` round the training hosts); a spare host holds `nproc_per_host`."""
    spares = job.ft.spares if job.ft.mode == "ckptless" else 0
    return job.cluster.nproc_per_host + -(-spares // job.cluster.num_hosts)


def manifests(job: JobConfig, *, run_dir: Path, secret: bytes | None) -> list[dict]:
    """Secret, ConfigMap, Service and JobSet, as dicts in the order they are applied. `secret` None: the dry
    run's placeholder."""
    name, namespace = jobset_name(run_dir), job.cluster.namespace
    secret_text = SECRET_PLACEHOLDER if secret is None else (secret.hex() + "\n").encode()
    return [
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": _metadata(name, namespace, name=f"{name}-secret"),
            "type": "Opaque",
            "data": {SECRET_KEY: base64.b64encode(secret_text).decode()},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(name, namespace, name=f"{name}-config"),
            "data": {CONFIG_KEY: pod_config_yaml(job, run_dir)},
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(name, namespace, name=f"{name}-coordinator"),
            "spec": {
                "clusterIP": "None",
                # The name resolves as soon as the pod has an address: agents wait on the coordinator, not on DNS.
                "publishNotReadyAddresses": True,
                "selector": _labels(name, "coordinator"),
                "ports": [{"name": "control", "port": coordinator_port(job), "targetPort": coordinator_port(job)}],
            },
        },
        jobset(job, run_dir=run_dir),
    ]


def jobset(job: JobConfig, *, run_dir: Path) -> dict:
    name, namespace = jobset_name(run_dir), job.cluster.namespace
    num_agents = job.cluster.num_hosts + job.cluster.spare_hosts
    coordinator_job = {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": COORDINATOR_BACKOFF_LIMIT,
        "podFailurePolicy": {
            "rules": [
                # The job's own outcome fails the Job, and the JobSet with it (rule CoordinatorEnded). First: a
                # coordinator stopped by SIGTERM (a drain of its node too) stopped the job cleanly, exit 130.
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": "coordinator",
                        "operator": "In",
                        "values": list(JOB_OUTCOME_EXIT_CODES),
                    },
                },
                # Otherwise a pod Kubernetes took away (its node lost, preemption): a new pod, not counted.
                {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            ]
        },
        "template": _pod_template(job, run_dir, "coordinator", coordinator_command(job, run_dir)),
    }
    # Any end of an agent's pod but success fails its Job at once, which the JobSet then recreates alone.
    agent_job = {
        "completions": 1,
        "parallelism": 1,
        "backoffLimit": 0,
        "template": _pod_template(job, run_dir, "agent", agent_command(job, run_dir)),
    }
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": _metadata(name, namespace, name=name),
        "spec": {
            "replicatedJobs": [
                {"name": "coordinator", "replicas": 1, "template": {"spec": coordinator_job}},
                {
                    "name": "agents",
                    "replicas": num_agents,
                    # Agents start once the coordinator's pod runs: an image pull there must not use up their wait.
                    "dependsOn": [{"name": "coordinator", "status": "Ready"}],
                    "template": {"spec": agent_job},
                },
            ],
            "successPolicy": {"operator": "All", "targetReplicatedJobs": ["coordinator"]},
            "failurePolicy": {
                # Needs JobSet v0.12.0+ with feature gate RestartJob=true (RestartJobAndIgnoreMaxRestarts).
                "rules": [
                    {"name": "CoordinatorEnded", "action": "FailJobSet", "targetReplicatedJobs": ["coordinator"]},
                    {
                        "name": "AgentLost",
                        "action": "RestartJobAndIgnoreMaxRestarts",
                        "targetReplicatedJobs": ["agents"],
                    },
                ],
            },
        },
    }


def pod_config_yaml(job: JobConfig, run_dir: Path) -> str:
    """The resolved config the pods run (what `recipes.schema.save_config` writes), with the pods' run directory and
    `dry_run` off: the dry run shows what a submission would apply."""
    pods_job = copy.deepcopy(job)
    pods_job.run.dir = str(pods_run_dir(job, run_dir))
    pods_job.dry_run = False
    return OmegaConf.to_yaml(OmegaConf.structured(pods_job))


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the ConfigMap's config) as literal blocks, readable as the file they become."""


_Dumper.add_representer(
    str,
    lambda dumper, text: dumper.represent_scalar("tag:yaml.org,2002:str", text, style="|" if "\n" in text else None),
)


def render(documents: list[dict]) -> str:
    """Documents as multi-document YAML, each opened by `---`."""
    return "".join("---\n" + yaml.dump(document, Dumper=_Dumper, sort_keys=False) for document in documents)


def _pod_template(job: JobConfig, run_dir: Path, role: str, command: list[str]) -> dict:
    cluster = job.cluster
    name = jobset_name(run_dir)
    mounts = [
        {"name": "runs", "mountPath": cluster.mount_path},
        {"name": "ckptless", "mountPath": str(CONFIG_DIR), "readOnly": True},
    ]
    volumes = [
        {"name": "runs", "persistentVolumeClaim": {"claimName": cluster.volume}},
        {
            "name": "ckptless",
            "projected": {
                "sources": [
                    {"configMap": {"name": f"{name}-config", "items": [{"key": CONFIG_KEY, "path": CONFIG_KEY}]}},
                    {
                        "secret": {
                            "name": f"{name}-secret",
                            "items": [{"key": SECRET_KEY, "path": SECRET_KEY, "mode": 0o440}],
                        }
                    },
                ],
            },
        },
    ]
    container: dict = {
        "name": role,
        "image": cluster.image,
        "command": command,
        "env": [{"name": "PYTHONUNBUFFERED", "value": "1"}],  # `kubectl logs` shows each line when it is printed
        "volumeMounts": mounts,
    }
    if role == "agent":
        # Workers share tensors through /dev/shm, which a container gets only 64 MiB of otherwise.
        mounts.append({"name": "shm", "mountPath": "/dev/shm"})
        volumes.append({"name": "shm", "emptyDir": {"medium": "Memory"}})
        if cluster.backend != "gloo":
            gpus = {"nvidia.com/gpu": slots_per_host(job)}
            container["resources"] = {"requests": dict(gpus), "limits": dict(gpus)}
    spec: dict = {
        "restartPolicy": "Never",  # a failed pod is replaced by a new one (podFailurePolicy needs it)
        # A stop lets workers finish their step (and a final checkpoint) within the collective timeout; an evicted
        # agent's host hands its ranks over within `ft.drain_timeout_s`.
        "terminationGracePeriodSeconds": int(max(cluster.collective_timeout_s, job.ft.drain_timeout_s)) + 30,
        "affinity": {
            # The job's pods on distinct nodes where the cluster allows: a node lost then costs one host at most.
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/instance": name}},
                            "topologyKey": "kubernetes.io/hostname",
                        },
                    }
                ]
            }
        },
        "containers": [container],
        "volumes": volumes,
    }
    if cluster.node_selector:
        spec["nodeSelector"] = dict(cluster.node_selector)
    if cluster.tolerations:
        spec["tolerations"] = [dict(toleration) for toleration in cluster.tolerations]
    return {"metadata": {"labels": _labels(name, role)}, "spec": spec}


def _labels(name: str, component: str | None = None) -> dict[str, str]:
    labels = {"app.kubernetes.io/name": "ckptless", "app.kubernetes.io/instance": name}
    if component is not None:
        labels["app.kubernetes.io/component"] = component
    return labels


def _metadata(jobset: str, namespace: str, *, name: str) -> dict:
    return {"name": name, "namespace": namespace, "labels": _labels(jobset)}


def _is_under(path: str, folder: str) -> bool:
    return PurePosixPath(folder) in PurePosixPath(path).parents
