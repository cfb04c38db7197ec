"""A run's charts in TensorBoard and Weights & Biases (`logging.*`), written while the job runs by a thread of
whatever serves it (`launcher.run.serve_job`: the launcher, or the coordinator a scheduler placed): it follows the run
directory (`launcher.chart_points`) and hands each new point to the enabled backends: TensorBoard event files under
`<run dir>/tensorboard/`, a W&B run with its local files under `<run dir>/wandb/`.

Workers never log: the rank-0 role moves between them, and serve_job is the one process that follows a job on every
cluster kind, detached Slurm jobs included. A serve_job started again (a coordinator requeued with the run directory)
reads the run directory from the start, and each backend first reads back what it holds (TensorBoard its event
files, W&B its `.wandb` transaction logs): no point is written twice, none is left out. The backends' packages are
imported only once a job that enables them runs.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from launcher.chart_points import EVENTS_TAG, TIME_LOST_TAG, FtEntry, RunFollower
from recipes.schema import JobConfig

POLL_S = 1.0
"""How often the run directory is read for new points."""


class RunCharts:
    """The charts of a job while it runs: `start_charts` starts them, `close` writes what the end of the job made final
    and closes the backends. Without a backend enabled, nothing runs."""

    def __init__(self, job: JobConfig, *, run_dir: Path) -> None:
        self.job = job
        self.run_dir = run_dir
        self.follower = RunFollower(run_dir)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._follow, name="charts", daemon=True)

    def _backends(self) -> list:
        """The enabled backends that could start; one that could not is said on the console, the others go on."""
        builders = []
        if self.job.logging.tensorboard:
            builders.append(("TensorBoard", lambda: TensorBoardCharts(self.run_dir / "tensorboard")))
        if self.job.logging.wandb:
            builders.append(("W&B", lambda: WandbCharts(self.job, run_dir=self.run_dir)))
        backends = []
        for name, build in builders:
            try:
                backends.append(build())
            except (OSError, ValueError) as error:
                print(f"charts: no {name} charts for this run: {error}", file=sys.stderr, flush=True)
        return backends

    def _follow(self) -> None:
        backends = []
        try:
            backends = self._backends()  # (reading back what they hold, and W&B's start, take a while: not in the loop)
            while True:
                ended = self.stop.is_set()
                points, entries = self.follower.poll(ended=ended)
                for backend in backends:
                    for step, values in points:
                        backend.scalars(step, values)
                    for entry in entries:
                        backend.ft_entry(entry)
                    backend.flush()
                if ended:
                    return
                self.stop.wait(POLL_S)
        finally:
            for backend in backends:
                backend.close()

    def close(self) -> None:
        """After the job ended: write the rest, close the backends (W&B online: until its upload is done)."""
        if self.thread.is_alive():
            self.stop.set()
            self.thread.join()


def start_charts(job: JobConfig, *, run_dir: Path) -> RunCharts:
    """Start following the run for the backends `logging.*` enables (none: a `RunCharts` that does nothing), and say
    where the charts are."""
    charts = RunCharts(job, run_dir=run_dir)
    if job.logging.tensorboard:
        print(f"charts: tensorboard --logdir {run_dir / 'tensorboard'}", flush=True)
    if job.logging.wandb:
        run_id = wandb_run_id(run_dir, resume=job.resume)
        upload = f"; upload: wandb sync {run_dir / 'wandb'}" if job.logging.wandb_mode == "offline" else ""
        print(f"charts: W&B run {run_id} ({job.logging.wandb_mode}{upload})", flush=True)
    if job.logging.tensorboard or job.logging.wandb:
        charts.thread.start()
    return charts


class TensorBoardCharts:
    """`<run dir>/tensorboard/`: TensorBoard event files (a restarted writer adds one beside the earlier ones)."""

    def __init__(self, directory: Path) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self.Event, self.Summary, self.text_pb = event_pb2.Event, summary_pb2.Summary, text_pb
        self.last_steps, self.ft_keys = _read_tensorboard(directory)
        self.writer = EventFileWriter(str(directory))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        new = {tag: value for tag, value in values.items() if step > self.last_steps.get(tag, 0)}
        if new:
            self._write(step, self.Summary(value=[self.Summary.Value(tag=t, simple_value=v) for t, v in new.items()]))
            self.last_steps.update(dict.fromkeys(new, step))

    def ft_entry(self, entry: FtEntry) -> None:
        if entry.key in self.ft_keys:
            return
        summary = self.text_pb(EVENTS_TAG, entry.text)  # one record with the time lost: written whole or not at all
        summary.value.add(tag=TIME_LOST_TAG, simple_value=entry.time_lost_s)
        self._write(entry.step, summary)
        self.ft_keys.add(entry.key)

    def _write(self, step: int, summary) -> None:
        self.writer.add_event(self.Event(wall_time=time.time(), step=step, summary=summary))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _read_tensorboard(directory: Path) -> tuple[dict[str, int], set[str]]:
    """What the event files under `directory` hold: the last step of each tag, and the ft entries' keys."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    last_steps: dict[str, int] = {}
    ft_keys = set()
    for path in sorted(directory.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                last_steps[value.tag] = max(last_steps.get(value.tag, 0), event.step)
                if value.tag == EVENTS_TAG:
                    ft_keys.add(value.tensor.string_val[0].decode().split("\n")[0])
    return last_steps, ft_keys


class WandbCharts:
    """A W&B run, its local files under `<run dir>/wandb/`: `train/*` and `eval/*` against `train/step`, the ft
    entries against `ft/step` (each also a row of the table `ft/events`, and an alert). Its id is kept in
    `<run dir>/wandb/run_id`, taken from the run named by `resume=` when there is one: a restarted serve_job, and a
    resumed job, continue the same W&B run."""

    def __init__(self, job: JobConfig, *, run_dir: Path) -> None:
        import wandb

        run_id = wandb_run_id(run_dir, resume=job.resume)
        directories = [run_dir / "wandb"]
        if job.resume is not None and wandb_run_id_of(Path(job.resume)) == run_id:
            directories.append(Path(job.resume) / "wandb")
        rows = [row for directory in directories for row in read_wandb_history(directory, run_id)]
        self.last_step = max((row["train/step"] for row in rows if "train/step" in row), default=0)
        self.ft_rows = [[row["ft/step"], row[TIME_LOST_TAG], row["ft/event"]] for row in rows if "ft/event" in row]
        self.ft_keys = {text.split("\n")[0] for _, _, text in self.ft_rows}
        self.next_step = max((row["_step"] + 1 for row in rows if "_step" in row), default=0)
        if job.logging.wandb_mode == "online" and not wandb.login(prompt=False, verify=False):
            raise ValueError(
                "logging.wandb_mode=online needs a W&B API key where the job is served: set WANDB_API_KEY or run "
                "`wandb login` there, or log offline (logging.wandb_mode=offline) and upload with "
                f"`wandb sync {run_dir / 'wandb'}`"
            )
        try:
            self.run = wandb.init(
                project=job.logging.wandb_project,
                entity=job.logging.wandb_entity,
                id=run_id,
                resume="allow",
                name=run_dir.name,
                dir=str(run_dir),
                mode=job.logging.wandb_mode,
                config=dataclasses.asdict(job),
                settings=wandb.Settings(console="off", silent=True, x_disable_stats=True, **_flushed_every(POLL_S)),
            )
        except wandb.errors.Error as error:
            raise ValueError(f"W&B did not start the run: {error}") from None
        # Online, the server may hold more than the local log (a writer lost with its node): its last rows count too.
        summary = self.run.summary
        self.last_step = max(self.last_step, summary.get("train/step", 0))
        self.ft_keys.add(summary.get("ft/event", "").split("\n")[0])
        self.next_step = max(self.next_step, self.run.step)
        self.run.define_metric("train/step")
        self.run.define_metric("ft/step")
        for pattern, step_metric in (("train/*", "train/step"), ("eval/*", "train/step"), ("ft/*", "ft/step")):
            self.run.define_metric(pattern, step_metric=step_metric)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if step > self.last_step:
            self._log({"train/step": step, **values})
            self.last_step = step

    def ft_entry(self, entry: FtEntry) -> None:
        import wandb

        if entry.key in self.ft_keys:
            return
        self.ft_rows.append([entry.step, entry.time_lost_s, entry.text])
        table = wandb.Table(columns=["step", "time_lost_s", "event"], data=self.ft_rows)
        self._log({"ft/step": entry.step, TIME_LOST_TAG: entry.time_lost_s, "ft/event": entry.text, EVENTS_TAG: table})
        self.ft_keys.add(entry.key)
        self.run.alert(title=f"ckptless: {entry.key}", text=entry.text, level=wandb.AlertLevel.WARN)

    def _log(self, row: dict) -> None:
        # W&B's own step counts rows on, across restarts (an offline run resumed does not know where it was); each
        # row is committed at once, not held until the next.
        self.run.log(row, step=self.next_step, commit=True)
        self.next_step += 1

    def flush(self) -> None:
        """(W&B writes as it is handed each row.)"""

    def close(self) -> None:
        self.run.finish()


def _flushed_every(seconds: float) -> dict:
    """W&B's service writes its local log every 15 s by default: every `seconds` instead, where this W&B version
    has the (private) setting, so that a writer started again finds all but the last moments there."""
    import wandb

    name = "x_transaction_log_flush_interval"
    return {name: seconds} if name in wandb.Settings.model_fields else {}


def wandb_run_id(run_dir: Path, *, resume: str | None) -> str:
    """The W&B run id of this run directory: the one it holds, else the one of the run `resume` names, else a new
    one; written down before the run starts, so whatever serves the job next continues it."""
    run_id = wandb_run_id_of(run_dir) or (wandb_run_id_of(Path(resume)) if resume is not None else None)
    if run_id is None:
        run_id = os.urandom(4).hex()
    if wandb_run_id_of(run_dir) != run_id:
        (run_dir / "wandb").mkdir(exist_ok=True)
        temporary = run_dir / "wandb" / "run_id.tmp"
        temporary.write_text(run_id + "\n")
        os.replace(temporary, run_dir / "wandb" / "run_id")
    return run_id


def wandb_run_id_of(run_dir: Path) -> str | None:
    path = run_dir / "wandb" / "run_id"
    return path.read_text().strip() if path.exists() else None


WANDB_LOG_HEADER = b":W&B\xe1\xbe\x00"
"""A `.wandb` transaction log's first bytes: its name, magic 0xBEE1 and version 0."""
WANDB_LOG_BLOCK = 32768
FULL, FIRST, LAST = 1, 2, 4


def read_wandb_history(directory: Path, run_id: str) -> list[dict]:
    """The history rows (key -> value) that the W&B runs with id `run_id` under `directory` (a `wandb/` folder) wrote
    to their local transaction logs, online or offline, in order."""
    from wandb.proto.wandb_internal_pb2 import Record

    rows = []
    for path in sorted(directory.glob(f"*-{run_id}/run-{run_id}.wandb")):
        for data in _log_records(path.read_bytes()):
            record = Record()
            record.ParseFromString(data)
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return rows


def _log_records(data: bytes) -> Iterator[bytes]:
    """The records of a W&B transaction log (LevelDB's log format: 32 KiB blocks of chunks, each with its CRC-32, type
    and length), up to the first torn or damaged one (a writer killed mid-record)."""
    if not data.startswith(WANDB_LOG_HEADER):
        return
    position, record = len(WANDB_LOG_HEADER), b""
    while position + 7 <= len(data):
        left = WANDB_LOG_BLOCK - position % WANDB_LOG_BLOCK
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        crc, length, kind = struct.unpack_from("<IHB", data, position)
        chunk = data[position + 7 : position + 7 + length]
        if len(chunk) < length or zlib.crc32(bytes([kind]) + chunk) != crc:
            return
        position += 7 + length
        record = chunk if kind in (FULL, FIRST) else record + chunk
        if kind in (FULL, LAST):
            yield record
