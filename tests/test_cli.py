"""run_sim.py privacy: the calibration report, and bad flags as one error naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dpfedavg import epsilon_for

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "run_sim.py"), *args], capture_output=True, text=True, timeout=300
    )


def test_privacy_cli_json() -> None:
    args = [
        "privacy",
        "--epsilon",
        "5",
        "--delta",
        "1e-5",
        "--num-clients",
        "3000",
        "--clients-per-round",
        "600",
        "--rounds",
        "100",
    ]
    result = _cli(*args, "--accountant", "rdp", "--clip", "50", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"noise_multiplier", "sigma", "epsilon_rdp", "epsilon_pld"} <= set(report)
    z = report["noise_multiplier"]
    assert report["epsilon_rdp"] <= 5.0 < epsilon_for(0.99 * z, 0.2, 100, 1e-5, "rdp")
    assert report["epsilon_pld"] < report["epsilon_rdp"]
    assert report["sigma"] == pytest.approx(z * 50 / 600)
    human = _cli(*args)
    assert human.returncode == 0 and "noise multiplier z" in human.stdout and "paper" in human.stdout


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--delta", "1.5"], "--delta = 1.5"),
        (["--epsilon", "0"], "--epsilon = 0"),
        (["--clients-per-round", "4000"], "exceeds --num-clients"),
    ],
)
def test_privacy_cli_bad_flags(flags: list[str], fragment: str) -> None:
    base = {
        "--epsilon": "5",
        "--delta": "1e-5",
        "--num-clients": "3000",
        "--clients-per-round": "600",
        "--rounds": "10",
    }
    for i in range(0, len(flags), 2):
        base[flags[i]] = flags[i + 1]
    result = _cli("privacy", *[x for kv in base.items() for x in kv])
    assert result.returncode == 2
    assert fragment in result.stderr and "Traceback" not in result.stderr
