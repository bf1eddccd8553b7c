"""Errors before start-up: ``python -m dpfedavg.check`` and the torch model's first forward pass.

Each mistake gives one line that names the key (or the model), the value and what is allowed, a non-zero exit,
and leaves nothing behind: no results folder, no file in the working folder. Every test is in-process and takes
well under a second (the model's check imports torch once).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dpfedavg import __main__ as run_module
from dpfedavg import check as check_module
from dpfedavg.config import OPTIONS, ConfigError

ROOT = Path(__file__).resolve().parents[1]


def _check(argv: list[str], capsys, cwd: Path, monkeypatch) -> tuple[int, str, str]:
    monkeypatch.chdir(cwd)
    code = check_module.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _one_line(text: str) -> str:
    lines = text.strip().splitlines()
    assert len(lines) == 1, text
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--run-config", "num-round=5"], ["unknown key 'num-round'", "did you mean 'num-rounds'"]),
        (["--run-config", "clip=-1.0"], ["'clip' = -1.0", "expected a float > 0"]),
        (["--run-config", "local-steps=2.5"], ["'local-steps' = 2.5", "expected an integer >= 1"]),
        (["--run-config", "algorithm='clipp'"], ["'algorithm' = 'clipp'", "did you mean 'clip'"]),
        (["--run-config", "task='quadratc'"], ["'task' = 'quadratc'", "did you mean 'quadratic'"]),
        (["--run-config", "num-clients=20"], ["'clients-per-round' = 100 exceeds 'num-clients' = 20"]),
        (["--num-supernodes", "10"], ["'num-supernodes' = 10", "'num-clients' = 100", "allowed: num-supernodes=100"]),
        (
            ["--run-config", "num-clients=20 clients-per-round=20.0 clients-per-node=3", "--num-supernodes", "20"],
            ["'num-supernodes' = 20", "ceil(20 / 3)", "allowed: num-supernodes=7"],
        ),
        (
            ["--federation-config", "num-supernodes=100 client-resources-num-cpus=0.5"],
            ["'client-resources-num-cpus' = 0.5", "whole number >= 1", "cannot be interpreted as an integer"],
        ),
        (["--federation-config", "client-resources-num-gpus=-1"], ["'client-resources-num-gpus' = -1"]),
        (["--run-config", "task=quadratic"], ["task=quadratic", "quote strings"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_a_mistake_is_one_line_naming_the_key_and_nothing_is_written(argv, expected, capsys, tmp_path, monkeypatch):
    code, out, err = _check(argv, capsys, tmp_path, monkeypatch)
    assert code == 2 and out == ""
    line = _one_line(err)
    assert line.startswith("error: ")
    assert [e for e in expected if e not in line] == [], line
    assert os.listdir(tmp_path) == []


def test_a_good_configuration_is_one_ok_line(capsys, tmp_path, monkeypatch):
    argv = ["--stream", "--federation-config", "num-supernodes=10 client-resources-num-cpus=1"]
    argv += ["--run-config", "num-clients=10 clients-per-round=4.0 server-momentum=0.8"]
    code, out, err = _check(argv, capsys, tmp_path, monkeypatch)
    assert (code, err) == (0, "")
    line = _one_line(out)
    assert line.startswith("ok: ") and "10 clients on 10 SuperNodes" in line and "r = 4 per round" in line
    assert os.listdir(tmp_path) == []


def test_plan_calibrates_the_noise(capsys, tmp_path, monkeypatch):
    code, out, _ = _check(["--plan", "--run-config", "num-rounds=5 num-clients=20 clients-per-round=20.0"],
                          capsys, tmp_path, monkeypatch)  # fmt: skip
    assert code == 0 and "z = " in out and "(epsilon, delta) = (" in out


def test_the_app_folder_gives_the_defaults_and_a_typo_there_is_named(capsys, tmp_path, monkeypatch):
    """``flwr run .`` reads ``[tool.flwr.app.config]``; so does the check (the repository's own app validates)."""
    code, out, _ = _check([str(ROOT), "--num-supernodes", "100"], capsys, tmp_path, monkeypatch)
    assert code == 0, out
    app = tmp_path / "app"
    app.mkdir()
    (app / "pyproject.toml").write_text("[tool.flwr.app.config]\nnum-rounds = 3\nlocal-step = 2\n")
    code, _, err = _check([str(app)], capsys, tmp_path, monkeypatch)
    assert code == 2 and "unknown key 'local-step' (did you mean 'local-steps'?)" in _one_line(err)
    (app / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    code, _, err = _check([str(app)], capsys, tmp_path, monkeypatch)
    assert code == 2 and "has no [tool.flwr.app.config]" in _one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["app"] and os.listdir(app) == ["pyproject.toml"]


def test_a_toml_file_is_read_as_flwr_run_reads_it(capsys, tmp_path, monkeypatch):
    (tmp_path / "run.toml").write_text("num-rounds = 3\nnum-client = 20\n")
    code, _, err = _check(["--run-config", str(tmp_path / "run.toml")], capsys, tmp_path, monkeypatch)
    assert code == 2 and "unknown key 'num-client' (did you mean 'num-clients'?)" in _one_line(err)
    code, _, err = _check(["--run-config", str(tmp_path / "run.toml"), "--run-config", "seed=1"],
                          capsys, tmp_path, monkeypatch)  # fmt: skip
    assert code == 2 and "cannot be passed alongside" in _one_line(err)
    assert sorted(os.listdir(tmp_path)) == ["run.toml"]


def test_the_repository_app_config_is_every_key_at_its_default():
    """The check without an app folder uses the dataclass defaults; with ``.`` the pyproject's: the same run."""
    table = check_module.read_app_config(ROOT)
    assert {opt.key: opt.default for opt in OPTIONS} == table


def test_the_check_imports_neither_flower_nor_ray():
    code = (
        "import sys, dpfedavg.check as c; c.main([]); print([m for m in ('flwr', 'ray', 'torch') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


# ------------------------------------------------------------------ the model's first forward pass
BROKEN = """
import numpy as np
import torch

from dpfedavg import TorchTask


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(100, 10)  # the data has 64 features

    def forward(self, x):
        return self.fc(x)


def make_task(cfg):
    rng = np.random.default_rng(0)
    clients = [(rng.normal(size=(5, 64)).astype(np.float32), rng.integers(0, 10, 5)) for _ in range(cfg.num_clients)]
    return TorchTask(cfg, model=Net, clients=clients)
"""


def test_a_model_whose_forward_fails_is_one_line_before_the_run_folder(capsys, tmp_path, monkeypatch):
    pytest.importorskip("torch")
    task = tmp_path / "brokentask.py"
    task.write_text(textwrap.dedent(BROKEN))
    out_dir = tmp_path / "outputs"
    monkeypatch.chdir(tmp_path)
    config = f"task='{task}:make_task' num-clients=4 clients-per-round=4.0 num-rounds=2 output-dir='{out_dir}'"
    code = run_module.main(["--run-config", config])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    line = _one_line(err)
    for part in (f"'task' = '{task}:make_task'", "the model Net", "first forward pass", "shape (1, 64)", "float32",
                 "RuntimeError: mat1 and mat2 shapes cannot be multiplied"):  # fmt: skip
        assert part in line, line
    assert not out_dir.exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["brokentask.py"]


def test_the_model_check_passes_a_working_model_and_skips_data_it_cannot_load():
    pytest.importorskip("torch")
    import numpy as np
    import torch

    from dpfedavg import TorchTask
    from dpfedavg.config import RunConfig
    from dpfedavg.tasks import build_task

    cfg = RunConfig(num_clients=2, clients_per_round=2.0)
    data = [(np.ones((3, 4), np.float32), np.array([0, 1, 0])) for _ in range(2)]
    task = build_task(cfg, lambda c: TorchTask(c, model=lambda: torch.nn.Linear(4, 2), clients=data))
    assert task.dim == 10

    def only_client_1(i: int):
        if i != 1:
            raise KeyError(f"client {i} is not on this node")
        return data[1]

    build_task(cfg, lambda c: TorchTask(c, model=lambda: torch.nn.Linear(4, 2), clients=only_client_1))
    # test data given as arrays: its first example is the input, no client's data is loaded
    with pytest.raises(ConfigError, match=r"shape \(1, 3\) \(float32, the first test example\)"):
        build_task(cfg, lambda c: TorchTask(c, model=lambda: torch.nn.Linear(4, 2), clients=only_client_1,
                                            test=(np.ones((5, 3), np.float32), np.zeros(5, np.int64))))  # fmt: skip
