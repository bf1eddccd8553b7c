"""The Python API: a notebook-style script with the public names only, and the base install alone."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dpfedavg
from dpfedavg import ConfigError, RunConfig, run

ROOT = Path(__file__).resolve().parents[1]

#: A user's own model and data, as in the documentation's "your own model" page.
MYTASK = """
import numpy as np
import torch

from dpfedavg import ArrayClients, TorchTask


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(6, 5)
        self.out = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def make_task(cfg):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((120, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    clients = [(x[rows], y[rows]) for rows in np.array_split(np.arange(100), cfg.num_clients)]
    return TorchTask(cfg, model=Net, clients=ArrayClients(clients, cfg.num_clients), loss="cross_entropy",
                     test=(x[100:], y[100:]))
"""

#: What a notebook cell does: public names only.
NOTEBOOK = """
import json, sys
from dpfedavg import RunConfig, TorchTask, run
import mytask

cfg = RunConfig(num_clients=6, clients_per_round=3.0, num_rounds=4, local_steps=3, local_lr=0.5, clip=2.0,
                delta=1e-5, output_dir=sys.argv[1], run_name="notebook")
result = run(cfg, task=mytask.make_task, progress=False)
print(json.dumps({"epsilon": result.epsilon, "directory": str(result.directory), "rounds": len(result.history),
                  "weights": result.weights.tolist(), "random_round": result.random_round,
                  "task": isinstance(mytask.make_task(cfg), TorchTask)}))
"""
CLI_CONFIG = (
    "task='mytask:make_task' num-clients=6 clients-per-round=3.0 num-rounds=4 local-steps=3 local-lr=0.5 clip=2.0 "
    "delta=1e-5 run-name='cli'"
)


def _metrics(directory: Path) -> list[dict[str, str]]:
    with (directory / "metrics.csv").open() as fh:
        return [{k: v for k, v in row.items() if k != "elapsed_s"} for row in csv.DictReader(fh)]


def _assert_same_metrics(a: Path, b: Path, rel: float = 1e-12) -> None:
    rows_a, rows_b = _metrics(a), _metrics(b)
    assert [list(r) for r in rows_a] == [list(r) for r in rows_b] and len(rows_a) == len(rows_b)
    for row_a, row_b in zip(rows_a, rows_b, strict=True):
        for key, value in row_a.items():
            if value == "" or row_b[key] == "":
                assert value == row_b[key], key
            else:
                assert float(value) == pytest.approx(float(row_b[key]), rel=rel, abs=1e-300), key


def test_the_public_names_are_exported_and_documented() -> None:
    for name in dpfedavg.__all__:
        obj = getattr(dpfedavg, name)
        assert name == "__version__" or (obj.__doc__ or "").strip(), f"{name} has no docstring"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        dpfedavg.nope  # noqa: B018


def test_a_notebook_script_with_public_names_equals_the_command_line(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    (tmp_path / "mytask.py").write_text(MYTASK)
    (tmp_path / "notebook.py").write_text(NOTEBOOK)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = tmp_path / "outputs"
    nb = subprocess.run([sys.executable, "notebook.py", str(out)], cwd=tmp_path, env=env, capture_output=True,
                        text=True, timeout=300)  # fmt: skip
    assert nb.returncode == 0, nb.stderr[-3000:]
    result = json.loads(nb.stdout.strip().splitlines()[-1])
    cli = subprocess.run(
        [sys.executable, "-m", "dpfedavg", "--run-config", f"{CLI_CONFIG} output-dir='{out}'"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr[-3000:]
    _assert_same_metrics(out / "notebook", out / "cli")
    model = np.load(out / "cli" / "model.npz")
    np.testing.assert_array_equal(np.asarray(result["weights"]), model["w_final"])
    final = json.loads((out / "notebook" / "config.json").read_text())["final"]
    assert result["epsilon"] == final["epsilon"] <= 5.0 and result["rounds"] == 5  # round 0 .. 4
    assert result["random_round"] == int(model["random_iterate_round"]) and result["task"]
    # the task object's name is what the run records, so its folder and resume checks are the task's
    recorded = json.loads((out / "notebook" / "config.json").read_text())["run_config"]["task"]
    assert recorded == "Net"  # the model's class


def test_run_takes_overrides_and_refuses_bad_ones_before_anything_is_written(tmp_path: Path) -> None:
    result = run(num_rounds=2, dim=10, output_dir=str(tmp_path), run_name="tiny", progress=False)
    assert [int(r["round"]) for r in result.history] == [0, 1, 2] and result.weights.shape == (10,)
    assert result.guarantee == "seeded" and result.directory == tmp_path / "tiny"
    with pytest.raises(ConfigError, match="did you mean 'num_rounds'"):
        run(num_round=2, output_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="not a Task: it lacks"):
        run(RunConfig(output_dir=str(tmp_path), run_name="bad"), task=lambda cfg: object(), progress=False)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
@pytest.mark.xdist_group("base-install")  # with the other tests of conftest.base_install
def test_the_base_install_runs_the_api_and_the_command_line(tmp_path: Path, base_install: Path) -> None:
    """``pip install -e .`` without extras is enough for ``run(...)`` and ``python -m dpfedavg``.

    The venv (`conftest.base_install`) lacks the optional packages (torch, flwr-datasets).
    """
    python = base_install
    out = tmp_path / "outputs"
    script = (
        "import sys; from dpfedavg import RunConfig, TorchTask, run; "
        f"r = run(RunConfig(num_rounds=3, dim=20, output_dir={str(out)!r}, run_name='api')); print(r.epsilon)"
    )
    api = subprocess.run([str(python), "-c", script], capture_output=True, text=True, timeout=300)
    assert api.returncode == 0 and "Traceback" not in api.stderr, api.stderr[-3000:]
    cli = subprocess.run(
        [str(python), "-m", "dpfedavg", "--progress",
         "--run-config", f"num-rounds=3 dim=20 output-dir='{out}' run-name='cli'"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0 and "Traceback" not in cli.stderr, cli.stderr[-3000:]
    assert (out / "cli" / "metrics.png").stat().st_size > 1000  # matplotlib is a base dependency: the picture
    _assert_same_metrics(out / "api", out / "cli")


def test_dpfedavg_run_is_the_api_function_even_after_the_command_line_module_is_imported(tmp_path: Path) -> None:
    """The command line is ``python -m dpfedavg`` (``dpfedavg.__main__``): no submodule shadows the ``run`` function."""
    import importlib.util

    import dpfedavg

    importlib.import_module("dpfedavg.__main__")
    assert importlib.util.find_spec("dpfedavg.run") is None  # one name, one meaning
    cfg = dpfedavg.RunConfig.from_run_config(
        {"num-rounds": 2, "num-clients": 4, "clients-per-round": 4.0, "dim": 5, "output-dir": str(tmp_path)}
    )
    result = dpfedavg.run(cfg, progress=False)
    assert result.history[-1]["round"] == 2 and result.directory.parent == tmp_path  # round 0, then rounds 1-2
