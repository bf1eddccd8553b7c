"""Configurations bounded before any work (issue 29, part 4).

Each key's range is what the code can honour; a value outside it is one `ConfigError` naming the key,
the value and the allowed range, raised when the config is built (or, for combinations only the privacy
plan can judge, by the plan), never a hang, a MemoryError or a traceback. The ``timeout`` marks below are
hang detectors (the issue's cases ran for minutes or exhausted memory), not speed targets: the measured
times are on the benchmarks page.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys

import pytest
from flwr.app import Context, RecordDict

from dpfedavg.config import ConfigError, RunConfig
from dpfedavg.flower import server_app
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.testing import InProcessGrid
from dpfedavg.server.run import plan_for


def _plan(values: dict):
    return plan_for(RunConfig.from_run_config(values))


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("values", "fragments"),
    [
        ({"num-rounds": 1_000_000}, ["'num-rounds' = 1000000", "100000"]),
        ({"num-rounds": 1e6}, ["'num-rounds'", "integer"]),
        ({"epsilon": 1e6}, ["'epsilon' = 1000000.0", "100"]),
        ({"clients-per-round": 1e-9}, ["'clients-per-round'", "q = r/n", "1e-06"]),
        ({"epsilon": 1e-6}, ["'epsilon' = 1e-06", "0.01"]),
        ({"epsilon": 0.0, "noise-multiplier": 1e300}, ["'noise-multiplier' = 1e+300", "1e+06"]),
        ({"delta": 1e-300}, ["'delta' = 1e-300", "1e-12"]),
    ],
    ids=[
        "num-rounds=1e6 (int)",
        "num-rounds=1e6",
        "epsilon=1e6",
        "clients-per-round=1e-9",
        "epsilon=1e-6",
        "noise-multiplier=1e300",
        "delta=1e-300",
    ],  # fmt: skip
)
def test_config_the_code_cannot_honour_is_one_config_error(values: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(values)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, message
    assert "\n" not in message


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("values", "fragments"),
    [
        # q = 1: K rounds compose to one Gaussian of std z / sqrt(K): z = 0.5 over 100000 rounds is 0.0016
        ({"epsilon": 0.0, "noise-multiplier": 0.5, "num-rounds": 100_000}, ["noise-multiplier", "rdp"]),
        ({"epsilon": 0.0, "noise-multiplier": 0.01, "num-rounds": 1, "clients-per-round": 10.0}, ["noise-multiplier"]),
        # PLD's discretization alone costs more than 0.01 over 100000 subsampled rounds, whatever z
        ({"epsilon": 0.01, "num-rounds": 100_000, "clients-per-round": 50.0}, ["epsilon", "noise multiplier"]),
    ],
)
def test_plan_the_pld_accountant_cannot_compute_is_one_config_error(values: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        _plan(values)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "values",
    [
        pytest.param(
            {"num-rounds": 100_000, "epsilon": 100.0, "num-clients": 100, "clients-per-round": 100.0},
            marks=pytest.mark.slow,
        ),
        {"num-rounds": 100_000, "epsilon": 5.0, "num-clients": 10**6, "clients-per-round": 1.0},
        pytest.param(
            {"num-rounds": 1, "epsilon": 100.0, "num-clients": 10**6, "clients-per-round": 1.0, "delta": 1e-12},
            marks=pytest.mark.slow,
        ),
        {"num-rounds": 1, "epsilon": 0.01, "num-clients": 1, "clients-per-round": 1.0, "delta": 0.1},
    ],
    ids=["K=1e5 q=1 eps=100", "K=1e5 q=1e-6 eps=5", "K=1 q=1e-6 eps=100 delta=1e-12", "K=1 q=1 eps=0.01"],
)
def test_calibration_terminates_at_the_corners_of_the_allowed_ranges(values: dict) -> None:
    """The bisection never builds a PLD below its floor and meets the target (checked with a fresh accountant)."""
    from dpfedavg.privacy.calibration import epsilon_for

    plan = _plan(values)
    assert plan.noise_multiplier > 0
    assert epsilon_for(plan.noise_multiplier, plan.q, plan.rounds, plan.delta, plan.accountant) <= values["epsilon"]


def test_rdp_accountant_takes_what_pld_refuses() -> None:
    plan = _plan({"epsilon": 0.0, "noise-multiplier": 0.5, "num-rounds": 100_000, "accountant": "rdp"})
    assert math.isfinite(plan.nominal_epsilon) and plan.nominal_epsilon > 100


# -------------------------------------------------------------- one ERROR line
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "values",
    [
        {"epsilon": 1e-6},
        {"epsilon": 0.0, "noise-multiplier": 1e300},
        {"epsilon": 0.01, "num-rounds": 100_000, "clients-per-round": 50.0},
    ],
    ids=["epsilon=1e-6", "noise-multiplier=1e300", "infeasible-target"],
)
def test_user_error_through_the_server_app_is_one_error_line(values: dict, tmp_path, dpfedavg_log) -> None:
    run_config = RunConfig(output_dir=str(tmp_path)).to_run_config() | values
    grid = InProcessGrid(client_app, 2, {})
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config)
    server_app.main(grid, context)
    errors = [r for r in dpfedavg_log if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and errors[0].exc_info is None, [r.getMessage() for r in errors]
    assert not list(tmp_path.iterdir())  # nothing was written


@pytest.mark.timeout(120)
def test_user_error_through_the_cli_is_one_line_and_exit_2(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dpfedavg", "--run-config",
         f"epsilon=0.01 num-rounds=100000 clients-per-round=50.0 output-dir='{tmp_path}'"],
        capture_output=True, text=True, timeout=110, check=False,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip() and not line.startswith("INFO")]
    assert len(lines) == 1 and lines[0].startswith("error:") and "Traceback" not in proc.stderr, proc.stderr
