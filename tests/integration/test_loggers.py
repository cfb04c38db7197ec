"""Charts in TensorBoard and Weights & Biases (`logging.*`), read back with TensorBoard's own reader and from W&B's
offline transaction log: every metrics line once per tag, a failure and its recovery at the step it struck, nothing
written twice or left out when the writer is killed and started again."""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tensorboard.backend.event_processing import event_accumulator

from ckptless_core.events import read_events
from launcher.chart_points import GOODPUT_TAG, METRIC_TAGS, ft_entries
from launcher.compose import compose_job
from launcher.errors import ConfigError
from launcher.goodput import report_from_events
from launcher.loggers import read_wandb_history, start_charts, wandb_run_id_of
from launcher.summary import recoveries, restarts
from recipes.schema import load_config
from tests.conftest import CHARTED_FAULT_STEP, CHARTED_STEPS, read_metrics, read_summary

STEPS, FAULT_STEP = CHARTED_STEPS, CHARTED_FAULT_STEP
KILLED_AFTER_STEP = 7
"""The restarted writer's first life sees the run up to this step (past the failure), its second the rest."""
RECORDED = Path(__file__).resolve().parents[1] / "data" / "goodput_runs"


@pytest.fixture(scope="module")
def kill_run(charted_recovery) -> Path:
    """tiny_llama with both loggers on, a worker killed at FAULT_STEP and replaced by the spare."""
    proc, run_dir = charted_recovery
    assert (
        f"charts: W&B run {wandb_run_id_of(run_dir)} (offline; upload: wandb sync {run_dir / 'wandb'})" in proc.stdout
    )
    return run_dir


def tensorboard_charts(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, str]]]:
    """Each scalar tag's (step, value) points and the `ft/events` texts, as TensorBoard reads them."""
    reader = event_accumulator.EventAccumulator(
        str(run_dir / "tensorboard"), size_guidance={event_accumulator.SCALARS: 0, event_accumulator.TENSORS: 0}
    )
    reader.Reload()
    scalars = {tag: [(e.step, e.value) for e in reader.Scalars(tag)] for tag in reader.Tags()["scalars"]}
    written = reader.Tensors("ft/events") if "ft/events" in reader.Tags()["tensors"] else []
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in written]
    return scalars, texts


def wandb_charts(run_dir: Path) -> tuple[dict[str, list[tuple[int, float]]], list[tuple[int, str]]]:
    """The same from the W&B run's offline logs: `train/*` against `train/step`, `ft/*` against `ft/step`."""
    scalars: dict[str, list[tuple[int, float]]] = {}
    texts = []
    for row in read_wandb_history(run_dir / "wandb", wandb_run_id_of(run_dir)):
        x = row.get("train/step", row.get("ft/step"))
        for tag, value in row.items():
            if tag.startswith(("train/", "eval/", "ft/time_lost_s")) and tag != "train/step":
                scalars.setdefault(tag, []).append((x, value))
        if "ft/event" in row:
            texts.append((row["ft/step"], row["ft/event"]))
    return scalars, texts


BACKENDS = {"tensorboard": tensorboard_charts, "wandb": wandb_charts}


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_metrics_line_is_charted_once_under_each_tag(kill_run, backend):
    scalars, _ = BACKENDS[backend](kill_run)
    metrics = read_metrics(kill_run)
    steps = [m["step"] for m in metrics]
    assert steps == list(range(1, STEPS + 1))
    for name, tag in METRIC_TAGS.items():
        if name not in metrics[0]:
            continue  # (`val_loss`: only on evaluation steps)
        assert [step for step, _ in scalars[tag]] == steps, tag
        assert [value for _, value in scalars[tag]] == pytest.approx([m[name] for m in metrics], rel=1e-6), tag
    goodput = [value for _, value in scalars[GOODPUT_TAG]]
    assert [step for step, _ in scalars[GOODPUT_TAG]] == steps
    assert all(value > 0 for value in goodput)
    # The goodput report's figure, with the median step time of the metrics lines.
    report = report_from_events(
        read_events(kill_run / "events"),
        mode="ckptless",
        world_size=2,
        spares=1,
        step_s=statistics.median(m["step_s"] for m in metrics),
    )
    assert goodput[-1] == pytest.approx(report["goodput"], rel=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_failure_and_its_recovery_are_charted_at_the_step_it_struck(kill_run, backend):
    scalars, texts = BACKENDS[backend](kill_run)
    (recovery,) = read_summary(kill_run)["recoveries"]
    assert scalars["ft/time_lost_s"] == [(FAULT_STEP, pytest.approx(recovery["time_to_recover_s"], rel=1e-6))]
    ((step, text),) = texts
    assert step == FAULT_STEP
    assert f"failure: worker1 (rank 1) during step {FAULT_STEP}: exit" in text
    assert all(phase in text for phase in ("detect", "rebuild", "transfer", "replay"))


def test_a_writer_killed_and_started_again_writes_nothing_twice_and_leaves_nothing_out(kill_run, tmp_path):
    # The first writer sees the run up to KILLED_AFTER_STEP (past the failure), writes it, and is killed with its W&B
    # service, as when the coordinator's node is lost; the second follows the whole run to its end.
    run_dir = tmp_path / "run"
    (run_dir / "events").mkdir(parents=True)
    shutil.copy(kill_run / "config.yaml", run_dir / "config.yaml")
    events = read_events(kill_run / "events")
    cut = min(e["t"] for e in events if e["event"] == "step_committed" and e["step"] == KILLED_AFTER_STEP + 1)
    lines = {path: path.read_text().splitlines(keepends=True) for path in (kill_run / "events").glob("*.jsonl")}
    for path, text in lines.items():
        (run_dir / "events" / path.name).write_text("".join(line for line in text if json.loads(line)["t"] < cut))
    metrics = (kill_run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run_dir / "metrics.jsonl").write_text("".join(metrics[:KILLED_AFTER_STEP]))
    first = subprocess.Popen(
        [sys.executable, "-c", FIRST_WRITER, str(run_dir)], start_new_session=True, stdout=subprocess.DEVNULL
    )
    try:
        _wait_until(lambda: _charted(run_dir) == (KILLED_AFTER_STEP, 1), first)
    finally:
        for pid in [first.pid, *_wandb_services_of(first.pid)]:
            os.kill(pid, signal.SIGKILL)
        first.wait()
    for path, text in lines.items():
        (run_dir / "events" / path.name).write_text("".join(text))
    (run_dir / "metrics.jsonl").write_text("".join(metrics))
    start_charts(load_config(run_dir / "config.yaml"), run_dir=run_dir).close()
    assert len(list((run_dir / "tensorboard").glob("events.out.tfevents.*"))) == 2
    assert len(list((run_dir / "wandb").glob("offline-run-*"))) == 2  # one W&B run, continued
    rows = _wandb_history_once_written(run_dir, rows=STEPS + 1)
    assert [row["_step"] for row in rows] == list(range(STEPS + 1))  # W&B's own step too: `wandb sync` keeps them all
    for backend, charts in BACKENDS.items():
        scalars, texts = charts(run_dir)
        for tag in (*[METRIC_TAGS[name] for name in ("loss", "lr", "world_size")], GOODPUT_TAG):
            assert [step for step, _ in scalars[tag]] == list(range(1, STEPS + 1)), (backend, tag)
        assert scalars["train/loss"] == tensorboard_charts(kill_run)[0]["train/loss"]
        assert [step for step, _ in texts] == [FAULT_STEP], backend


def test_a_resumed_job_continues_the_w_and_b_run_of_the_run_it_resumes(kill_run, tmp_path):
    # A job resumed from kill_run's checkpoint of step 5 writes steps 6 to 12 in a run directory of its own.
    run_dir = tmp_path / "resumed"
    (run_dir / "events").mkdir(parents=True)
    metrics = read_metrics(kill_run)
    later = [{**metrics[-1], "step": step} for step in (STEPS + 1, STEPS + 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in [*metrics[FAULT_STEP:], *later]))
    job = load_config(kill_run / "config.yaml")
    job.resume, job.logging.tensorboard = str(kill_run), False
    start_charts(job, run_dir=run_dir).close()
    assert wandb_run_id_of(run_dir) == wandb_run_id_of(kill_run)
    run_id = wandb_run_id_of(run_dir)
    rows = [row for d in (kill_run, run_dir) for row in read_wandb_history(d / "wandb", run_id)]
    assert [row["train/step"] for row in rows if "train/step" in row] == list(range(1, STEPS + 3))
    assert [row["_step"] for row in rows] == list(range(STEPS + 3))


def test_online_without_an_api_key_says_so_and_tensorboard_charts_the_run_anyway(kill_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(kill_run / "events", run_dir / "events")
    for name in ("config.yaml", "metrics.jsonl"):
        shutil.copy(kill_run / name, run_dir / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")} | {"HOME": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-c", ONLINE_WRITER, str(run_dir)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "charts: no W&B charts for this run: logging.wandb_mode=online needs a W&B API key" in proc.stderr
    scalars, texts = tensorboard_charts(run_dir)
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, STEPS + 1)) and len(texts) == 1


ONLINE_WRITER = """
import sys
from pathlib import Path
from launcher.loggers import start_charts
from recipes.schema import load_config
run_dir = Path(sys.argv[1])
job = load_config(run_dir / "config.yaml")
job.logging.wandb_mode = "online"
start_charts(job, run_dir=run_dir).close()
"""


FIRST_WRITER = """
import signal, sys
from pathlib import Path
from launcher.loggers import start_charts
from recipes.schema import load_config
run_dir = Path(sys.argv[1])
start_charts(load_config(run_dir / "config.yaml"), run_dir=run_dir)
signal.pause()
"""


def _charted(run_dir: Path) -> tuple[int, int]:
    """The last step W&B's log and TensorBoard's files both hold, and how many ft entries both hold."""
    if not (run_dir / "tensorboard").exists() or wandb_run_id_of(run_dir) is None:
        return 0, 0
    charts = [charts(run_dir) for charts in BACKENDS.values()]
    last = min(max((step for step, _ in scalars.get("train/loss", [])), default=0) for scalars, _ in charts)
    return last, min(len(texts) for _, texts in charts)


def _wait_until(condition, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert process.poll() is None, f"the writer exited with {process.returncode}"
        assert time.monotonic() < deadline, "the writer did not chart the run in time"
        time.sleep(0.2)


def _wandb_history_once_written(run_dir: Path, *, rows: int, timeout_s: float = 10.0) -> list[dict]:
    """The W&B history in the run's local logs once it holds `rows` rows (or what it holds after `timeout_s`). Once in
    CI (1 run of 8) the second writer's last rows were not in its log when its `finish()` had returned, and were there
    when read again later: the log is W&B's service's to write, in a process of its own."""
    deadline = time.monotonic() + timeout_s
    while True:
        history = read_wandb_history(run_dir / "wandb", wandb_run_id_of(run_dir))
        if len(history) >= rows or time.monotonic() > deadline:
            return history
        time.sleep(0.1)


def _wandb_services_of(pid: int) -> list[int]:
    """The W&B service processes started for process `pid` (in sessions of their own: its group's kill misses them)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if any(arg.endswith(b"wandb-core") for arg in args) and b"--pid" in args and str(pid).encode() in args:
            found.append(int(cmdline.parent.name))
    return found


@pytest.mark.parametrize("mode", ["ckptless", "checkpoint_restart"])
def test_recorded_failures_are_charted_as_the_summary_reports_them(mode, tmp_path):
    # 3300 steps with a SIGKILL about every 600 (torchrun restarting every worker under checkpoint_restart): what the
    # writer keeps of the events while following gives what the summary computes from all of them.
    run_dir = tmp_path / "run"
    (run_dir / "events").mkdir(parents=True)
    shutil.copy(RECORDED / f"{mode}_A" / "config.yaml", run_dir / "config.yaml")
    for path in (RECORDED / f"{mode}_A" / "events").glob("*.jsonl.gz"):
        (run_dir / "events" / path.name.removesuffix(".gz")).write_bytes(gzip.decompress(path.read_bytes()))
    job = load_config(run_dir / "config.yaml")
    job.logging.tensorboard = True
    start_charts(job, run_dir=run_dir).close()
    scalars, texts = tensorboard_charts(run_dir)
    events = read_events(run_dir / "events")
    recovered = restarts(events) if mode == "checkpoint_restart" else recoveries(events)
    assert len(recovered) == 5 and all(r["completed"] for r in recovered)
    expected = [(r["interrupted_step"], pytest.approx(r["time_to_recover_s"], rel=1e-6)) for r in recovered]
    assert scalars["ft/time_lost_s"] == expected
    assert texts == [(entry.step, entry.text) for entry in ft_entries(events)]
    assert all("failure: worker" in text and "recovered: generation" in text for _, text in texts)


@pytest.mark.parametrize("package", ["tensorboard", "wandb"])
def test_a_logger_whose_package_is_missing_is_refused_when_composing(package):
    hide = f"import sys; sys.modules[{package!r}] = None; from launcher.cli import main; sys.exit(main(sys.argv[1:]))"
    args = ["recipe=tiny_llama", f"logging.{package}=true", "dry_run=true"]
    proc = subprocess.run([sys.executable, "-c", hide, *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"logging.{package}=true needs the {package} package" in proc.stderr
    assert f"pip install {package}" in proc.stderr


def test_an_unknown_wandb_mode_is_refused_when_composing():
    with pytest.raises(ConfigError, match="logging.wandb_mode='cloud': choose offline"):
        compose_job(["recipe=tiny_llama", "logging.wandb=true", "logging.wandb_mode=cloud"])
