"""`cluster=k8s` without a cluster: every core-kind manifest (the Secret, the ConfigMap, the Service, and each
replicated job's template as a `batch/v1` Job) validated strictly against the Kubernetes schemas of pinned versions
(`kubernetes-validate`); the JobSet against its API (`kubeflow-trainer-api`'s pydantic models) plus this project's
strict checks, which those models do not make (unknown keys, the enums, a failure rule for every replicated job, the
success policy on the coordinator); the pods' commands as the contract with `launcher.coordinate` and the agent
says; the dry run through the CLI; the secret; the refusals."""

from __future__ import annotations

import base64
import copy
import os
import re
import stat
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from kubeflow_trainer_api.models.jobset_v1alpha2_failure_policy_rule import JobsetV1alpha2FailurePolicyRule
from kubeflow_trainer_api.models.jobset_v1alpha2_job_set import JobsetV1alpha2JobSet
from pydantic import BaseModel

from ckptless_core.channel import read_secret
from launcher import cli
from launcher.clusters import k8s
from launcher.compose import compose_job
from launcher.errors import ConfigError
from recipes.schema import load_config

REPO = Path(__file__).resolve().parents[2]
KUBERNETES_VERSIONS = ("1.32.0", "1.36.0")
"""The oldest Kubernetes JobSet v0.12.0 is tested on (its README), and the API it is built against (k8s.io/api
v0.36)."""
ACTIONS = (
    "FailJobSet",
    "RestartJobSet",
    "RestartJobSetAndIgnoreMaxRestarts",
    "RestartJob",
    "RestartJobAndIgnoreMaxRestarts",
)
"""JobSet v0.12.0's `FailurePolicyAction` enum (`+kubebuilder:validation:Enum` in api/jobset/v1alpha2)."""
JOB_FAILURE_REASONS = (
    "BackoffLimitExceeded",
    "DeadlineExceeded",
    "FailedIndexes",
    "MaxFailedIndexesExceeded",
    "PodFailurePolicy",
)
"""The Job failure reasons JobSet's webhook accepts in `onJobFailureReasons`."""
RULE_NAME = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")
DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
TINY = ["recipe=tiny_llama", "cluster=k8s", "dry_run=true"]
EVERY_OPTION = [
    "cluster.num_hosts=3",
    "cluster.nproc_per_host=2",
    "cluster.nproc=null",
    "cluster.spare_hosts=2",
    "trainer.global_batch_size=24",
    "trainer.micro_batch_size=4",
    "cluster.image=registry.example/ml/ckptless:dev",
    "cluster.namespace=training",
    "cluster.volume=shared-runs",
    "cluster.mount_path=/mnt/runs",
    "cluster.ifname=eth1",
    "cluster.coordinator_port=31000",
    "+cluster.node_selector={cloud.google.com/gke-accelerator: nvidia-h100-80gb, pool: train}",
    "cluster.tolerations=[{key: nvidia.com/gpu, operator: Exists, effect: NoSchedule},"
    "{key: node.kubernetes.io/unreachable, operator: Exists, effect: NoExecute, tolerationSeconds: 30}]",
]
CONFIGURATIONS = {"defaults": [], "gloo": ["cluster.backend=gloo"], "every option": EVERY_OPTION}


def compose(*overrides: str):
    return compose_job([*TINY, *overrides]).job


@pytest.fixture(scope="module", params=list(CONFIGURATIONS), ids=list(CONFIGURATIONS))
def rendered(request, tmp_path_factory):
    """(job, run dir, the documents a submission applies), per configuration."""
    run_dir = tmp_path_factory.mktemp("k8s") / "run-1"
    job = compose(*CONFIGURATIONS[request.param])
    return job, run_dir, k8s.manifests(job, run_dir=run_dir, secret=bytes(range(32)))


def schema_problem(document: dict, version: str) -> str | None:
    try:
        kubernetes_validate.validate(document, version, strict=True)
    except kubernetes_validate.ValidationError as error:  # its str() is the whole schema: name the place instead
        return f"{error.message} at {'/'.join(map(str, error.absolute_path))}"
    return None


def replicated_job_as_job(jobset: dict, replicated: dict) -> dict:
    """A replicated job's template as the `batch/v1` Job the JobSet controller creates from it (index 0)."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": f"{jobset['metadata']['name']}-{replicated['name']}-0",
            "namespace": jobset["metadata"]["namespace"],
            **replicated["template"].get("metadata", {}),
        },
        "spec": replicated["template"]["spec"],
    }


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_core_kind_documents_and_each_replicated_jobs_job_validate_strictly(rendered, version):
    _, _, documents = rendered
    *core, jobset = documents
    assert [d["kind"] for d in core] == ["Secret", "ConfigMap", "Service"]
    jobs = [replicated_job_as_job(jobset, replicated) for replicated in jobset["spec"]["replicatedJobs"]]
    problems = {f"{d['kind']} {d['metadata']['name']}": schema_problem(d, version) for d in [*core, *jobs]}
    assert {name: problem for name, problem in problems.items() if problem} == {}


def test_the_strict_checks_refuse_what_kubernetes_would():
    assert schema_problem({"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}, "spec": {"ip": 1}}, "1.32")


# --- the JobSet: its API's models, and the checks those models leave out -----------------------------------------


def unknown_keys(model: type[BaseModel], data: dict, path: str = "") -> list[str]:
    """Keys of `data` that `model` (or any model below it) does not have, as paths."""
    fields = {(field.alias or name): field.annotation for name, field in model.model_fields.items()}
    problems = [f"{path}.{key}" for key in data if key not in fields]
    for key, value in data.items():
        if key in fields:
            problems += _unknown_below(fields[key], value, f"{path}.{key}")
    return problems


def _unknown_below(annotation, value, path: str) -> list[str]:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, typing.Annotated) or str(origin) == "types.UnionType":
        inner = [arg for arg in args if arg is not type(None)]
        return _unknown_below(inner[0], value, path) if inner else []
    if origin is list and isinstance(value, list):
        return [p for i, item in enumerate(value) for p in _unknown_below(args[0], item, f"{path}[{i}]")]
    if origin is dict and isinstance(value, dict):
        return [p for key, item in value.items() for p in _unknown_below(args[1], item, f"{path}.{key}")]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel) and isinstance(value, dict):
        return unknown_keys(annotation, value, path)
    return []


def jobset_problems(document: dict) -> list[str]:
    """What JobSet's API models accept but a JobSet controller (v0.12.0, feature gate RestartJob) would refuse or
    run differently from the design: each as a line."""
    problems = [f"unknown key {path}" for path in unknown_keys(JobsetV1alpha2JobSet, document)]
    JobsetV1alpha2JobSet.from_dict(document)  # types (strict strings and integers), required fields
    if document["apiVersion"] != "jobset.x-k8s.io/v1alpha2" or document["kind"] != "JobSet":
        problems.append(f"not a JobSet v1alpha2: {document['apiVersion']} {document['kind']}")
    spec, name = document["spec"], document["metadata"]["name"]
    replicated = {job["name"]: job for job in spec["replicatedJobs"]}
    for job_name, job in replicated.items():
        longest = f"{name}-{job_name}-{max(job['replicas'] - 1, 0)}"
        if not DNS_LABEL.match(longest) or len(longest) > 63:
            problems.append(f"Job name {longest} is not a DNS label of at most 63 characters")
        for i, dependency in enumerate(job.get("dependsOn", [])):
            if dependency["name"] not in replicated or dependency["status"] not in ("Ready", "Complete"):
                problems.append(f"{job_name}.dependsOn[{i}] = {dependency}")
    if spec["replicatedJobs"][0].get("dependsOn"):
        problems.append("the first replicated job cannot depend on another")
    rules = spec.get("failurePolicy", {}).get("rules", [])
    if len({rule["name"] for rule in rules}) != len(rules):
        problems.append("failure rules' names are not unique")
    for rule in rules:
        if rule["action"] not in ACTIONS:
            problems.append(f"rule {rule['name']}: action {rule['action']!r} is not one of {ACTIONS}")
        if not RULE_NAME.match(rule["name"]):
            problems.append(f"rule name {rule['name']!r} is not valid")
        problems += [f"rule {rule['name']}: no replicated job {t!r}" for t in rule.get("targetReplicatedJobs", [])
                     if t not in replicated]  # fmt: skip
        problems += [f"rule {rule['name']}: reason {r!r}" for r in rule.get("onJobFailureReasons", [])
                     if r not in JOB_FAILURE_REASONS]  # fmt: skip
        if rule["action"] in ("RestartJob", "RestartJobAndIgnoreMaxRestarts"):
            problems += [f"{n}: over 1024 replicas under {rule['action']}" for n, j in replicated.items()
                         if j["replicas"] > 1024]  # fmt: skip
    for job_name in replicated:
        # The first rule that matches any failure of this job: without one, a failure recreates the whole JobSet.
        catch_all = [
            rule
            for rule in rules
            if job_name in rule.get("targetReplicatedJobs", []) or not rule.get("targetReplicatedJobs")
            if not rule.get("onJobFailureReasons") and not rule.get("onJobFailureMessagePatterns")
        ]
        if not catch_all:
            problems.append(f"replicated job {job_name} has no failure rule for every failure")
    success = spec.get("successPolicy")
    if success is None or success["operator"] not in ("All", "Any"):
        problems.append(f"success policy {success}")
    elif success.get("targetReplicatedJobs") != ["coordinator"]:
        problems.append(f"the success policy targets {success.get('targetReplicatedJobs')}, not the coordinator")
    return problems


def test_the_jobset_is_valid_for_its_api_and_for_the_strict_checks(rendered):
    jobset = rendered[2][-1]
    assert jobset_problems(jobset) == []


def test_the_strict_checks_bite(rendered):
    jobset = rendered[2][-1]
    broken = []
    for break_it in (
        lambda js: js["spec"].update(failurePolicy2={}),
        lambda js: js["spec"]["replicatedJobs"][1].update(replica=3),
        lambda js: js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0].update(
            commands=[]
        ),
        lambda js: js["spec"]["failurePolicy"]["rules"][1].update(action="RecreateJob"),
        lambda js: js["spec"]["failurePolicy"]["rules"].pop(),
        lambda js: js["spec"]["failurePolicy"]["rules"][0].update(onJobFailureReasons=["PodFailurePolicy"]),
        lambda js: js["spec"]["successPolicy"].update(targetReplicatedJobs=["agents"]),
        lambda js: js["metadata"].update(name="x" * 60),
    ):
        mutated = copy.deepcopy(jobset)
        break_it(mutated)
        broken.append(len(jobset_problems(mutated)))
    assert 0 not in broken


def test_the_action_enum_is_the_one_the_api_package_describes():
    description = JobsetV1alpha2FailurePolicyRule.model_fields["action"].description
    assert set(re.findall(r"\b[A-Z][A-Za-z]+\b", description.split("Valid values are")[1])) == set(ACTIONS)


def test_the_failure_policy_recreates_a_lost_agents_job_alone_and_the_coordinators_end_is_the_jobsets(rendered):
    job, _, documents = rendered
    spec = documents[-1]["spec"]
    rules = {rule["targetReplicatedJobs"][0]: rule for rule in spec["failurePolicy"]["rules"]}
    assert rules["agents"]["action"] == "RestartJobAndIgnoreMaxRestarts"  # every loss survivable, none counted
    assert rules["coordinator"]["action"] == "FailJobSet"
    coordinator, agents = spec["replicatedJobs"]
    assert coordinator["replicas"] == 1 and coordinator["name"] == "coordinator"
    assert agents["replicas"] == job.cluster.num_hosts + job.cluster.spare_hosts
    assert agents["template"]["spec"]["backoffLimit"] == 0  # any end of the pod but success fails its Job
    assert {agents["template"]["spec"]["completions"], agents["template"]["spec"]["parallelism"]} == {1}
    policy = coordinator["template"]["spec"]["podFailurePolicy"]["rules"]
    # The job's outcome (130: stopped by SIGTERM, a drain's too) ends the JobSet; a pod taken away is replaced.
    assert policy[0]["action"] == "FailJob" and policy[0]["onExitCodes"]["values"] == [2, 3, 4, 5, 130]
    assert policy[1] == {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}
    for replicated in (coordinator, agents):
        assert replicated["template"]["spec"]["template"]["spec"]["restartPolicy"] == "Never"


# --- what the pods run, and with what ---------------------------------------------------------------------------


def pod_spec(documents: list[dict], replicated_job: str) -> dict:
    jobs = {job["name"]: job for job in documents[-1]["spec"]["replicatedJobs"]}
    return jobs[replicated_job]["template"]["spec"]["template"]


def test_the_pods_run_the_contracted_commands_on_the_volume_with_the_secret_and_config_mounted(rendered, tmp_path):
    job, run_dir, documents = rendered
    secret, config_map, service, jobset = documents
    namespace, mount = job.cluster.namespace, job.cluster.mount_path
    pods_run_dir = f"{mount}/{run_dir.name}"
    port = str(job.cluster.coordinator_port or 29400)
    coordinator, agent = pod_spec(documents, "coordinator"), pod_spec(documents, "agents")
    service_name = f"{service['metadata']['name']}.{namespace}.svc"
    assert coordinator["spec"]["containers"][0]["command"] == [
        "python", "-m", "launcher.coordinate", pods_run_dir, "--config", "/etc/ckptless/config.yaml",
        "--secret-file", "/etc/ckptless/control.secret", "--bind", "0.0.0.0", "--port", port,
        "--advertise", service_name,
    ]  # fmt: skip
    ifname = ["--ifname", job.cluster.ifname] if job.cluster.ifname else []
    assert agent["spec"]["containers"][0]["command"] == [
        "python", "-m", "ckptless_core.agent", "--coordinator-file", f"{pods_run_dir}/coordinator/address",
        "--secret-file", "/etc/ckptless/control.secret", "--run-dir", pods_run_dir, *ifname,
        "--connect-timeout-s", "600", "--preload", "recipes.train", "transformers.models.llama.modeling_llama",
    ]  # fmt: skip
    # The Service's name finds the coordinator's pod, and only it.
    assert service["spec"]["clusterIP"] == "None"
    selector = service["spec"]["selector"].items()
    assert selector <= coordinator["metadata"]["labels"].items()
    assert not selector <= agent["metadata"]["labels"].items()
    for pod in (coordinator, agent):
        spec, container = pod["spec"], pod["spec"]["containers"][0]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        mounts = {m["mountPath"]: volumes[m["name"]] for m in container["volumeMounts"]}
        assert mounts[mount]["persistentVolumeClaim"] == {"claimName": job.cluster.volume}
        sources = mounts["/etc/ckptless"]["projected"]["sources"]
        assert sources[0]["configMap"]["name"] == config_map["metadata"]["name"]
        assert sources[0]["configMap"]["items"] == [{"key": "config.yaml", "path": "config.yaml"}]
        assert sources[1]["secret"]["name"] == secret["metadata"]["name"]
        assert sources[1]["secret"]["items"][0]["path"] == "control.secret"
        assert container["image"] == job.cluster.image
        assert spec.get("nodeSelector", {}) == job.cluster.node_selector
        assert spec.get("tolerations", []) == job.cluster.tolerations
    for document in documents:
        assert document["metadata"]["namespace"] == namespace
    # The secret file holds the job's secret as agents and the coordinator read it.
    (tmp_path / "control.secret").write_bytes(base64.b64decode(secret["data"]["control.secret"]))
    assert read_secret(path=str(tmp_path / "control.secret")) == bytes(range(32))
    # The config the coordinator copies into the run directory: this job, in the pods' run directory.
    (tmp_path / "config.yaml").write_text(config_map["data"]["config.yaml"])
    pods_job = load_config(tmp_path / "config.yaml")
    assert pods_job.run.dir == pods_run_dir and pods_job.dry_run is False
    pods_job.run.dir, pods_job.dry_run = job.run.dir, job.dry_run
    assert pods_job == job


def test_each_agent_pod_asks_for_a_gpu_per_worker_slot_spares_included_and_none_with_gloo(tmp_path):
    def gpus(*overrides):
        documents = k8s.manifests(compose(*overrides), run_dir=tmp_path / "r", secret=None)
        container = pod_spec(documents, "agents")["spec"]["containers"][0]
        assert "resources" not in pod_spec(documents, "coordinator")["spec"]["containers"][0]
        resources = container.get("resources")
        if resources is None:
            return None
        assert resources["requests"] == resources["limits"]
        return resources["limits"]["nvidia.com/gpu"]

    assert gpus("cluster.num_hosts=2", "cluster.nproc_per_host=4", "cluster.nproc=null", "ft.spares=1",
                "trainer.global_batch_size=32", "trainer.micro_batch_size=4") == 5  # fmt: skip
    assert gpus("cluster.num_hosts=2", "cluster.nproc_per_host=4", "cluster.nproc=null", "ft.spares=0",
                "trainer.global_batch_size=32", "trainer.micro_batch_size=4") == 4  # fmt: skip
    assert gpus("ft=none") == 1
    assert gpus("cluster.backend=gloo") is None


def test_jobset_names_are_dns_labels_short_enough_and_distinct(tmp_path):
    assert k8s.jobset_name(Path("/x/20261206-171901")) == "ckptless-20261206-171901"
    long_a, long_b = (k8s.jobset_name(Path(f"/x/My_Experiment.{'v' * 60}{end}")) for end in "ab")
    assert long_a != long_b
    for name in (long_a, long_b, k8s.jobset_name(Path("/x/__--"))):
        assert DNS_LABEL.match(name) and len(name) <= k8s.NAME_MAX


# --- the dry run and the submission -----------------------------------------------------------------------------


def dry_run_documents(stdout: str) -> list[dict]:
    """The documents the plan prints under `workers` (indented by the plan)."""
    lines = stdout.split("     workers\n", 1)[1].split("\ndry run:", 1)[0]
    return [document for document in yaml.safe_load_all(textwrap.dedent(lines)) if document is not None]


def test_a_dry_run_through_the_cli_prints_the_documents_with_every_option_at_its_default_and_writes_nothing(
    tmp_path,
):
    run_dir = tmp_path / "run"
    shown = subprocess.run(
        [sys.executable, "-m", "launcher", "recipe=tiny_llama", "cluster=k8s", "dry_run=true", f"run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert shown.returncode == 0, shown.stderr
    assert "\n    ---\n" in shown.stdout
    documents = dry_run_documents(shown.stdout)
    assert [d["kind"] for d in documents] == ["Secret", "ConfigMap", "Service", "JobSet"]
    assert documents == k8s.manifests(compose(f"run.dir={run_dir}"), run_dir=run_dir, secret=None)
    assert base64.b64decode(documents[0]["data"]["control.secret"]) == k8s.SECRET_PLACEHOLDER
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_submit_writes_the_manifests_with_a_fresh_secret_and_prints_how_to_apply_them(tmp_path, capsys):
    job = compose("dry_run=false")
    run_dir = tmp_path / "run"
    plan = "\n".join(k8s.worker_lines(job, run_dir=run_dir))  # a submission's plan names the files it writes
    assert f"are written into {run_dir / 'k8s'}/" in plan and "---" not in plan and not run_dir.exists()
    secrets = []
    for _ in range(2):
        assert k8s.submit(job, run_dir=run_dir, recipe="tiny_llama") == 0
        folder = run_dir / "k8s"
        assert sorted(p.name for p in folder.iterdir()) == list(k8s.MANIFEST_FILES)
        written = [yaml.safe_load(path.read_text()) for path in sorted(folder.iterdir())]
        assert stat.S_IMODE(os.stat(folder / "00-secret.yaml").st_mode) == 0o600
        secrets.append(base64.b64decode(written[0]["data"]["control.secret"]))
        placeholder = k8s.manifests(job, run_dir=run_dir, secret=None)
        placeholder[0]["data"] = written[0]["data"]
        assert written == placeholder
    assert secrets[0] != secrets[1] and all(len(bytes.fromhex(s.decode())) == 32 for s in secrets)
    said = capsys.readouterr().out
    assert f"kubectl apply -f {run_dir / 'k8s'}\n" in said
    assert f"kubectl logs -n default -f job/{k8s.jobset_name(run_dir)}-coordinator-0" in said
    assert f"/runs/{run_dir.name}/summary.json" in said
    assert secrets[1].decode().strip() not in said


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["ft=checkpoint_restart", "ft.checkpoint_every=10", "ft.spares=0", "cluster.spare_hosts=0"],
         "ft=checkpoint_restart runs torchrun, which cluster=k8s does not place"),
        (["cluster.coordinator_address=10.0.0.1"], "cluster.coordinator_address is cluster=hosts's"),
        (["cluster.mount_path=runs"], "cluster.mount_path='runs': give an absolute path"),
        (["cluster.namespace=Team_A"], "cluster.namespace='Team_A' is not a Kubernetes namespace name"),
        (["cluster.tolerations=[{key: a, seconds: 3}]"], r"cluster.tolerations\[0\] has \['seconds'\]"),
        (["resume=/elsewhere/run"], "resume=/elsewhere/run: on cluster=k8s give the earlier run's directory"),
    ],
)  # fmt: skip
def test_what_cannot_run_on_k8s_is_refused_naming_the_option(overrides, message):
    with pytest.raises(ConfigError, match=message):
        compose(*overrides)


def test_another_kinds_option_is_refused_with_exit_2(capsys):
    assert cli.main(["recipe=tiny_llama", "cluster=k8s", "cluster.partition=x", "dry_run=true"]) == 2
    assert "cluster.partition applies to cluster=slurm only, not to cluster=k8s" in capsys.readouterr().err
