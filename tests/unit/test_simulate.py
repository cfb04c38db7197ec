"""The scale simulator: exact timelines for fixed failures, the Young-Daly first-order model, calibration, the CLI."""

import json
import math
from dataclasses import replace

import pytest

from launcher.simulate.__main__ import main
from launcher.simulate.calibration import calibrate, predict, predict_report
from launcher.simulate.costs import (
    CHECKPOINT_RESTART,
    CKPTLESS,
    LLAMA3_ACCELERATOR_MTBF_S,
    SCALING_ASSUMPTIONS,
    CostModel,
    FailureModel,
    young_daly_interval_s,
)
from launcher.simulate.engine import expected, simulate

NO_FAILURES = FailureModel(times_s=())


def restart_costs(**changes) -> CostModel:
    """Small round numbers: recovery = detect 1 + restart 3 + load 2 = 6 s."""
    base = CostModel(
        strategy=CHECKPOINT_RESTART,
        reference_world_size=8,
        step_s=1.0,
        checkpoint_write_s=2.0,
        checkpoint_load_s=2.0,
        checkpoint_every_s=10.0,
        detect_s=1.0,
        restart_s=3.0,
        restart_s_per_rank=0.0,
    )
    return replace(base, **changes)


def ckptless_costs(**changes) -> CostModel:
    """Recovery = detect 1 + rebuild 3 + transfer 4e9 / 2e9 = 2 + residual 0.5 = 6.5 s; no checkpoints."""
    base = CostModel(
        strategy=CKPTLESS,
        reference_world_size=8,
        step_s=2.0,
        checkpoint_every_s=None,
        detect_s=1.0,
        rebuild_s=3.0,
        rebuild_s_per_rank=0.0,
        state_bytes_per_rank=4e9,
        bandwidth_bytes_per_s=2e9,
        residual_s=0.5,
    )
    return replace(base, **changes)


def test_no_failures_goodput_is_one_minus_checkpoint_overhead():
    # 100 steps of 1 s, a 2 s write every 10 s of training and none after the last step: 9 writes.
    run = simulate(restart_costs(), world_size=8, num_steps=100, failures=NO_FAILURES)
    assert run.wall_s == pytest.approx(118.0)
    assert run.checkpoints == 9
    assert run.goodput == pytest.approx(100 / 118)

    # Over a fixed wall time: 83 whole cycles of 10 + 2 s (996 s), then 4 s of training: 834 committed steps.
    run = simulate(restart_costs(), world_size=8, horizon_s=1000.0, failures=NO_FAILURES)
    assert run.committed_steps == 834
    assert run.goodput == pytest.approx(0.834)
    assert run.goodput == pytest.approx(10 / 12, abs=0.001)


def test_ckptless_without_failures_or_checkpoints_has_goodput_one():
    run = simulate(ckptless_costs(), world_size=8, num_steps=50, failures=NO_FAILURES)
    assert run.goodput == 1.0
    assert run.lost_accelerator_hours == 0.0


def test_ckptless_loses_recovery_plus_the_partial_step_per_failure():
    """Steps of 2 s, recovery 6.5 s. Failure at 10.5 s: 0.5 s into step 6, that partial step is lost; training
    resumes at 17 s from step 5's end (10 s of work). Failure at 40 s: 10 + 23 = 33 s of work, 1 s into a step,
    back to 32. Wall = 100 s of work + 2 x 6.5 + 0.5 + 1.0 = 114.5 s."""
    run = simulate(ckptless_costs(), world_size=8, num_steps=50, failures=FailureModel(times_s=(10.5, 40.0)))
    assert run.failures == 2
    assert run.wall_s == pytest.approx(100 + 2 * 6.5 + 0.5 + 1.0)
    assert run.recovery_s == pytest.approx(13.0)
    assert run.productive_s == 100.0
    assert run.lost_accelerator_hours == pytest.approx((run.wall_s - 100) * 8 / 3600)


def test_checkpoint_restart_fixed_failures_give_the_hand_computed_wall_time():
    """Steps of 1 s, a 2 s write every 10 s of training, recovery 6 s, 30 steps, failures at 15 s and 40 s.

    0-10 train, 10-12 write (saved 10), 12-15 train (13); failure: back to 10, recover 15-21; 21-31 train (20),
    31-33 write (saved 20), 33-40 train (27); failure: back to 20, recover 40-46; 46-56 train (30): done at 56 s."""
    run = simulate(restart_costs(), world_size=8, num_steps=30, failures=FailureModel(times_s=(15.0, 40.0)))
    assert run.wall_s == pytest.approx(56.0)
    assert run.checkpoints == 2
    assert run.checkpoint_overhead_s == pytest.approx(4.0)
    assert run.recovery_s == pytest.approx(12.0)
    assert run.goodput == pytest.approx(30 / 56)


def test_a_failure_during_recovery_restarts_it_and_one_during_a_write_loses_the_checkpoint():
    """0-10 train, 10-12 write; failure at 11 s (mid-write: the checkpoint is lost, back to 0), recovery from 11 s;
    failure at 13 s (mid-recovery: it starts over), recovery 13-19; 19-29 train, 29-31 write, 31-41 train: done."""
    run = simulate(restart_costs(), world_size=8, num_steps=20, failures=FailureModel(times_s=(11.0, 13.0)))
    assert run.wall_s == pytest.approx(41.0)
    assert run.checkpoints == 1
    assert run.recovery_s == pytest.approx(2.0 + 6.0)


def test_checkpoint_restart_matches_the_first_order_young_daly_model():
    """Cycle = tau of training + delta of writing; a failure (rate lambda) falls uniformly in the cycle and loses the
    time since the last completed checkpoint, (tau + delta) / 2 on average, plus the recovery R. With wall W and
    useful work P: W = P (tau + delta) / tau + lambda W (R + (tau + delta) / 2), so to first order in lambda:
    goodput = tau / (tau + delta) x (1 - lambda (R + (tau + delta) / 2))."""
    tau, delta, recovery, mtbf = 100.0, 5.0, 20.0, 5000.0
    costs = restart_costs(checkpoint_every_s=tau, checkpoint_write_s=delta, restart_s=12.0, checkpoint_load_s=7.0)
    assert costs.recovery_s == recovery
    failures = FailureModel(failures_per_hour=3600 / mtbf)
    simulated = expected(costs, world_size=8, horizon_s=5e5, failures=failures, seeds=20)
    analytic = tau / (tau + delta) * (1 - (recovery + (tau + delta) / 2) / mtbf)
    assert simulated.goodput == pytest.approx(analytic, abs=0.005)

    # The Young-Daly interval wastes less than intervals four times shorter or longer.
    auto = replace(costs, checkpoint_every_s=0.0)
    best = expected(auto, world_size=8, horizon_s=5e5, failures=failures, seeds=20)
    assert best.checkpoint_every_s == round(young_daly_interval_s(delta, mtbf))
    for interval in (best.checkpoint_every_s / 4, best.checkpoint_every_s * 4):
        other = expected(replace(costs, checkpoint_every_s=interval), world_size=8, horizon_s=5e5, failures=failures)
        assert other.goodput < best.goodput - 0.01


def test_costs_scale_with_n_as_documented():
    costs = CostModel(strategy=CKPTLESS, reference_world_size=1024)
    big = costs.at(16384)
    assert big.restart_s == pytest.approx(costs.restart_s + costs.restart_s_per_rank * (16384 - 1024))
    assert big.rebuild_s > costs.rebuild_s
    assert big.transfer_s == costs.transfer_s
    assert big.detect_s == costs.detect_s and big.step_s == costs.step_s
    assert big.checkpoint_write_s == costs.checkpoint_write_s
    assert replace(costs, checkpoint_scaling_exponent=1.0).at(4096).checkpoint_write_s == 4 * costs.checkpoint_write_s

    # Failures: linear in N, 419 interruptions in 54 days at 16,384 GPUs (Llama 3).
    failures = FailureModel()
    assert failures.rate_per_s(16384) * 54 * 86400 == pytest.approx(419)
    assert failures.rate_per_s(32768) == pytest.approx(2 * failures.rate_per_s(16384))
    assert FailureModel().accelerator_mtbf_s == LLAMA3_ACCELERATOR_MTBF_S

    # The spare pool grows with N, but more slowly than N, and never below one unit.
    small = simulate(costs, world_size=64, horizon_s=3600.0)
    large = simulate(costs, world_size=131072, horizon_s=3600.0)
    assert small.spare_accelerators == costs.accelerators_per_spare
    assert large.spare_accelerators > small.spare_accelerators
    assert large.spare_overhead < small.spare_overhead


def measured_report(mode: str, *, failures: int = 4, training_overhead: float = 0.02) -> dict:
    """A local run built to the model: 2000 steps of 0.5 s, fixed recovery phases, a residual of 1.0 s per failure
    (checkpoint_restart) or 0.5 s (ckptless), and 2% of the training time lost without failures (warm-up, jitter).
    A failure's loss is time_to_recover_s - step / 2: it lands half-way through a step on average."""
    step_s, steps = 0.5, 2000
    if mode == CHECKPOINT_RESTART:
        every_steps, write_s = 20, 0.5  # a 10 s interval: a failure loses (10 + 0.5) / 2 s of work on average,
        redone_steps = 10  # 10 steps + half the interrupted one
        phases = {"detect_s": 0.5, "rebuild_s": 3.0, "transfer_s": 0.5, "bytes_moved": 0}
        residual_s, writes = 1.0, steps // every_steps - 1
    else:
        every_steps, write_s, writes, redone_steps, residual_s = 0, 0.0, 0, 0, 0.5
        phases = {"detect_s": 0.5, "rebuild_s": 1.0, "transfer_s": 0.2, "bytes_moved": 100_000_000}
    replay_s = (redone_steps + 1) * step_s
    recover_s = phases["detect_s"] + phases["rebuild_s"] + phases["transfer_s"] + replay_s + residual_s
    productive = steps * step_s
    wall = productive * (1 + training_overhead) + writes * write_s + failures * (recover_s - step_s / 2)
    recovery = {"completed": True, **phases, "replay_s": replay_s, "time_to_recover_s": recover_s}
    return {
        "mode": mode,
        "world_size": 4,
        "spares": 1 if mode == CKPTLESS else 0,
        "train_wall_s": wall,
        "steps": steps,
        "step_s": step_s,
        "productive_s": productive,
        "goodput": productive / wall,
        "failures": failures,
        "failure_times_s": [wall * (i + 0.5) / failures for i in range(failures)],
        "recoveries": [{**recovery, "redone_steps": redone_steps} for _ in range(failures)],
        "checkpoint": {
            "count": writes,
            "write_s": write_s,
            "overhead_s": writes * write_s,
            "load_s": 0.5,
            "every_steps": every_steps,
        },
        "spare_s": 0.0,
        "worker_s": wall * 4,
    }


@pytest.mark.parametrize("mode", [CHECKPOINT_RESTART, CKPTLESS])
def test_calibrated_model_reproduces_its_run_and_predicts_one_with_more_failures(mode):
    report = measured_report(mode)
    costs = calibrate(report)
    assert costs.strategy == mode and costs.reference_world_size == 4 and costs.step_s == 0.5
    assert costs.residual_s == pytest.approx(1.0 if mode == CHECKPOINT_RESTART else 0.5)
    assert costs.training_overhead == pytest.approx(0.02)
    if mode == CKPTLESS:
        assert costs.transfer_s == pytest.approx(0.2)
        assert costs.bandwidth_bytes_per_s == pytest.approx(5e8)
    else:
        assert (costs.restart_s, costs.checkpoint_load_s, costs.checkpoint_every_s) == (3.0, 0.5, 10.0)

    rate = report["failures"] / report["train_wall_s"] * 3600
    assert predict(costs, failures_per_hour=rate, num_steps=report["steps"]) == pytest.approx(
        report["goodput"], abs=0.01
    )
    # Another run with three times the failures: the loss not tied to failures is not multiplied by their count.
    other = measured_report(mode, failures=12)
    assert other["goodput"] < report["goodput"] - 0.015
    assert predict_report(costs, other) == pytest.approx(other["goodput"], abs=0.01)


def test_calibrate_refuses_reports_it_cannot_use():
    with pytest.raises(ValueError, match="mode"):
        calibrate({**measured_report(CKPTLESS), "mode": "none"})
    with pytest.raises(ValueError, match="no completed recovery"):
        calibrate({**measured_report(CKPTLESS), "recoveries": [], "failures": 0})
    with pytest.raises(ValueError, match="step_s"):
        calibrate({key: value for key, value in measured_report(CKPTLESS).items() if key != "step_s"})


def test_cli_writes_json_and_plot(tmp_path, capsys):
    report = tmp_path / "run.json"
    report.write_text(json.dumps(measured_report(CKPTLESS)))
    out_json, out_png = tmp_path / "sim.json", tmp_path / "sim.png"
    argv = ["--sizes", "64,4096", "--days", "2", "--seeds", "2", "--json", str(out_json), "--plot", str(out_png)]
    assert main([*argv, "--calibrate", str(report)]) == 0

    printed = capsys.readouterr().out
    assert "4096" in printed and "goodput" in printed
    data = json.loads(out_json.read_text())
    assert [row[CHECKPOINT_RESTART]["world_size"] for row in data["results"]] == [64, 4096]
    assert data["costs"][CKPTLESS]["reference_world_size"] == 4  # the calibrated model
    for row in data["results"]:
        for result in row.values():
            assert 0 < result["goodput"] <= 1
            assert result["lost_accelerator_hours"] >= 0
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_prints_the_scaling_assumptions(capsys):
    assert main(["--assumptions"]) == 0
    printed = capsys.readouterr().out
    assert all(name in printed for name in SCALING_ASSUMPTIONS)
    assert "Llama 3" in printed


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--step-s", "-1"], "--step-s"),
        (["--sizes", ""], "--sizes"),
        (["--sizes", "64,abc"], "--sizes"),
        (["--calibrate", "/nonexistent/run.json"], "--calibrate"),
        (["--min-spares", "1.5"], "--min-spares"),
    ],
)
def test_cli_rejects_bad_input_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


def test_simulate_needs_exactly_one_length():
    with pytest.raises(ValueError, match="exactly one"):
        simulate(restart_costs(), world_size=8)
    with pytest.raises(ValueError, match="step_s"):
        CostModel(strategy=CKPTLESS, step_s=0.0)
    with pytest.raises(ValueError, match="restart_s"):
        CostModel(strategy=CHECKPOINT_RESTART, restart_s=-1.0)
    assert math.isclose(young_daly_interval_s(5.0, 5000.0), 223.606797749979)
