"""The simulator, calibrated from one recorded local run, predicts the goodput of another local run with a
different failure rate, for both strategies.

The recorded runs (`tests/data/goodput_runs/`, events compressed) were made on this project's 2-core CPU machine by
`scripts/bench_goodput.py`: run A with the defaults (3300 steps, a SIGKILL about every 600 steps), run B with
`--steps 1200 --failure-every-steps 200 --mtbf-s 20` (three times the failure rate). Each run directory holds its
`config.yaml` and its `events/*.jsonl.gz`; goodput is measured as the benchmark does, against the run's own median
step-to-step time.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from launcher.goodput import goodput_report
from launcher.simulate.calibration import calibrate, predict_report

RECORDED = Path(__file__).resolve().parents[1] / "data" / "goodput_runs"


def recorded_report(name: str, tmp_path: Path) -> dict:
    source = RECORDED / name
    run_dir = tmp_path / name
    (run_dir / "events").mkdir(parents=True)
    shutil.copy(source / "config.yaml", run_dir / "config.yaml")
    for path in (source / "events").glob("*.jsonl.gz"):
        (run_dir / "events" / path.name.removesuffix(".gz")).write_bytes(gzip.decompress(path.read_bytes()))
    return goodput_report(run_dir)


@pytest.mark.parametrize("mode", ["ckptless", "checkpoint_restart"])
def test_calibrated_on_one_run_the_simulator_predicts_another_within_3_points(mode, tmp_path):
    calibration_run = recorded_report(f"{mode}_A", tmp_path)
    other_run = recorded_report(f"{mode}_B", tmp_path)
    rate_a = calibration_run["failures"] / calibration_run["train_wall_s"]
    rate_b = other_run["failures"] / other_run["train_wall_s"]
    assert rate_b > 2 * rate_a  # a different failure rate, not the same run twice

    predicted = predict_report(calibrate(calibration_run), other_run, seeds=400)

    assert predicted == pytest.approx(other_run["goodput"], abs=0.03), (predicted, other_run["goodput"])
