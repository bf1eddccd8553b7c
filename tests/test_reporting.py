"""What a new user reads off a run (issue 39, item 4): epsilon every round, test accuracy, loading a run back,
keyword typos, a missing data-dir, and what is sent of a model's buffers."""

from __future__ import annotations

import importlib
import logging
import math
from pathlib import Path

import numpy as np
import pytest

import dpfedavg
from dpfedavg import ConfigError, RunConfig, run

torch = pytest.importorskip("torch")

#: A fixed noise multiplier: no calibration, so the tests time only the rounds and their accounting.
Z = 1.2


# ------------------------------------------------------------------ epsilon every round
def _independent_pld_epsilon(q: float, z: float, rounds: int, delta: float) -> float:
    """dp-accounting's own PLDAccountant (not dpfedavg's): ``rounds`` Poisson-sampled Gaussian rounds."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant

    accountant = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-3)
    accountant.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    return accountant.get_epsilon(delta)


@pytest.fixture(scope="module")
def quadratic_run(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("runs")
    cfg = RunConfig(num_clients=20, clients_per_round=5.0, num_rounds=6, local_steps=2, dim=10, epsilon=0.0,
                    noise_multiplier=Z, delta=1e-5, output_dir=str(out), run_name="eps")  # fmt: skip
    return run(cfg, progress=False)


def test_the_batched_engine_reports_epsilon_after_every_round(quadratic_run) -> None:
    """Every round's epsilon is a number (never NaN), rising, and dp-accounting's own PLD accountant's value."""
    result = quadratic_run
    rows = [row for row in result.history if row["round"] >= 1]
    eps = [row["epsilon"] for row in rows]
    assert len(eps) == 6 and all(math.isfinite(e) for e in eps), eps
    assert all(b > a for a, b in zip(eps, eps[1:], strict=False)), eps
    assert eps[-1] == result.epsilon
    for k in (2, 6):  # an independent accountant, to the discretization (1e-3 per round at most)
        assert eps[k - 1] == pytest.approx(_independent_pld_epsilon(0.25, Z, k, 1e-5), rel=2e-3, abs=1e-3)


def test_a_batch_of_runs_reports_epsilon_after_every_round(tmp_path: Path) -> None:
    from dpfedavg.engines.batched_runs import run_batch
    from dpfedavg.io.results import read_metrics

    base = RunConfig(num_clients=20, clients_per_round=5.0, num_rounds=4, local_steps=2, dim=10, epsilon=0.0,
                     noise_multiplier=Z, delta=1e-5, output_dir=str(tmp_path))  # fmt: skip
    dirs = run_batch([base.replace(run_name="a", clip=1.0), base.replace(run_name="b", clip=2.0)])
    for directory in dirs:
        eps = [row["epsilon"] for row in read_metrics(directory / "metrics.csv") if row["round"] >= 1]
        assert len(eps) == 4 and all(math.isfinite(e) for e in eps), eps


def test_the_epsilon_panel_of_metrics_png_is_a_line_over_the_rounds(quadratic_run, monkeypatch) -> None:
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from dpfedavg.io.results import RunRecorder

    drawn: list[tuple[str, int]] = []
    plot = Axes.plot

    def spy(self, *args, **kwargs):
        drawn.append((kwargs.get("color"), len(args[0])))
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(Axes, "plot", spy)
    recorder = RunRecorder.__new__(RunRecorder)  # the finished run's files, without rewriting metrics.csv
    recorder.directory = quadratic_run.directory
    recorder.metrics_path = quadratic_run.directory / "metrics.csv"
    recorder.columns = tuple(quadratic_run.history[0])
    assert recorder.write_plot("suboptimality") is not None
    assert ("tab:red", 6) in drawn, drawn  # epsilon after each of the 6 rounds


def test_no_round_logs_epsilon_nan(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="dpfedavg")
    run(RunConfig(num_clients=20, clients_per_round=5.0, num_rounds=3, local_steps=1, dim=5, epsilon=0.0,
                  noise_multiplier=Z, delta=1e-5, output_dir=str(tmp_path)), progress=False)  # fmt: skip
    lines = [
        r.getMessage() for r in caplog.records if r.getMessage().startswith("round ") and "sampled" in r.getMessage()
    ]
    assert len(lines) == 3 and not any("epsilon nan" in line for line in lines), lines


# ------------------------------------------------------------------ a model of one's own
class Net(torch.nn.Module):
    def __init__(self, outputs: int = 3) -> None:
        super().__init__()
        self.hidden = torch.nn.Linear(4, 5)
        self.out = torch.nn.Linear(5, outputs)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(x)))


def _data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((80, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)


def _cfg(tmp_path: Path, name: str) -> RunConfig:
    return RunConfig(num_clients=4, clients_per_round=4.0, num_rounds=2, local_steps=3, local_lr=0.5, clip=2.0,
                     epsilon=0.0, noise_multiplier=1.0, delta=1e-5, torch_dtype="float64", output_dir=str(tmp_path),
                     run_name=name)  # fmt: skip


def _task(cfg: RunConfig, loss, model=Net, y=None, **kw):
    x, labels = _data()
    y = labels if y is None else y
    clients = [(x[rows], y[rows]) for rows in np.array_split(np.arange(60), cfg.num_clients)]
    return dpfedavg.TorchTask(cfg, model=model, clients=clients, loss=loss, test=(x[60:], y[60:]), **kw)


def _my_cross_entropy(out, y):
    return torch.nn.functional.cross_entropy(out, y, reduction="none")


def test_a_custom_loss_on_class_scores_reports_test_accuracy(tmp_path: Path) -> None:
    """The accuracy of the returned model, recomputed from the module it loads into."""
    cfg = _cfg(tmp_path, "custom-loss")
    result = run(cfg, task=lambda c: _task(c, _my_cross_entropy), progress=False)
    model = result.load_into(Net().double())
    x, y = _data()
    with torch.no_grad():
        predicted = model(torch.as_tensor(x[60:], dtype=torch.float64)).argmax(dim=1).numpy()
    assert result.history[-1]["test_accuracy"] == pytest.approx(float(np.mean(predicted == y[60:])), abs=1e-12)


def test_a_regression_loss_has_no_accuracy_and_the_key_error_says_how(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "regression")
    x, _ = _data()
    targets = x[:, :1].astype(np.float32)

    def mse(out, y):
        return ((out - y) ** 2).mean(dim=1)

    result = run(cfg, task=lambda c: _task(c, mse, model=lambda: Net(outputs=1), y=targets), progress=False)
    assert "test_loss" in result.history[-1]
    with pytest.raises(KeyError, match=r"not a column .*test_loss.*classification=True"):
        result.history[-1]["test_accuracy"]


def test_classification_false_turns_accuracy_off(tmp_path: Path) -> None:
    task = _task(_cfg(tmp_path, "off"), _my_cross_entropy, classification=False)
    assert "test_accuracy" not in task.metric_names


# ------------------------------------------------------------------ a finished run, loaded back
def test_load_run_gives_the_runs_result_and_load_into_its_model(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "load")
    result = run(cfg, task=lambda c: _task(c, "cross_entropy"), progress=False)
    loaded = dpfedavg.load_run(result.directory)
    np.testing.assert_array_equal(loaded.weights, result.weights)
    np.testing.assert_array_equal(loaded.random_iterate, result.random_iterate)
    assert (loaded.epsilon, loaded.delta, loaded.guarantee, loaded.random_round) == (
        result.epsilon, result.delta, result.guarantee, result.random_round)  # fmt: skip
    assert len(loaded.history) == len(result.history)
    model = loaded.load_into(Net())
    # independently of the task's layout: named_parameters() order, each raveled
    flat = np.concatenate([p.detach().double().numpy().ravel() for p in model.parameters()])
    np.testing.assert_allclose(flat, result.weights.astype(np.float32), rtol=0, atol=0)
    random_model = loaded.load_into(Net(), iterate="random")
    assert np.allclose(torch.nn.utils.parameters_to_vector(random_model.parameters()).detach().numpy(),
                       result.random_iterate.astype(np.float32))  # fmt: skip
    with pytest.raises(ValueError, match="trainable entries"):
        loaded.load_into(Net(outputs=2))
    assert "load_run" in dpfedavg.__all__


def test_load_weights_round_trips_a_transposed_layout() -> None:
    from dpfedavg.tasks.torch_task import linear_softmax_model, load_weights

    cfg = RunConfig(num_clients=2, clients_per_round=2.0, torch_dtype="float64")
    x, y = np.zeros((4, 3)), np.array([0, 1, 2, 0])
    task = dpfedavg.TorchTask(cfg, model=lambda: linear_softmax_model(3, 3), clients=[(x[:2], y[:2]), (x[2:], y[2:])])
    w = np.arange(task.dim, dtype=np.float64)
    module = load_weights(linear_softmax_model(3, 3).double(), w)
    np.testing.assert_array_equal(module.weight.detach().numpy(), w[:9].reshape(3, 3).T)  # w holds vec(W), W (d, c)


def test_load_run_of_an_unfinished_folder_names_the_missing_file(tmp_path: Path) -> None:
    (tmp_path / "metrics.csv").write_text("round\n")
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        dpfedavg.load_run(tmp_path)


# ------------------------------------------------------------------ keyword typos
def test_an_unknown_keyword_gets_did_you_mean() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'num_round' \(did you mean 'num_rounds'\?\)"):
        RunConfig(num_round=5)
    with pytest.raises(ConfigError, match=r"unknown key 'epsilom' \(did you mean 'epsilon'\?\)"):
        run(epsilom=3.0)
    with pytest.raises(ConfigError, match=r"did you mean 'num-rounds'"):  # the CLI's spelling, for the CLI's keys
        RunConfig.from_run_config({"num-round": 5})


# ------------------------------------------------------------------ a missing data-dir
def test_a_missing_data_dir_is_one_line_before_any_download(tmp_path: Path, monkeypatch, capsys) -> None:
    from dpfedavg.tasks import datasets

    def no_download(spec):
        raise AssertionError("the dataset hub was called for a data-dir that does not exist")

    monkeypatch.setattr(datasets, "_load_flwr_datasets", no_download)
    missing = tmp_path / "no-such-folder"
    with pytest.raises(ConfigError, match=r"'data-dir' = .*no-such-folder.* does not exist.*fashion_mnist"):
        datasets.prepare_dataset("fmnist", data_dir=missing, cache_dir=tmp_path / "cache")
    cli = importlib.import_module("dpfedavg.__main__")  # the command line
    code = cli.main(["--run-config", f"task='fmnist' data-dir='{missing}' cache-dir='{tmp_path / 'cache'}' "
                     f"output-dir='{tmp_path / 'out'}'"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "'data-dir'" in err[0], err
    (tmp_path / "empty").mkdir()  # a folder without the files: the download is tried, and its failure is one line too
    monkeypatch.setattr(datasets, "_load_flwr_datasets", lambda spec: (_ for _ in ()).throw(OSError("offline")))
    code = cli.main(["--run-config", f"task='fmnist' data-dir='{tmp_path / 'empty'}' cache-dir='{tmp_path / 'cache'}' "
                     f"output-dir='{tmp_path / 'out'}'"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "OSError: offline" in err[0], err


# ------------------------------------------------------------------ buffers
class BatchNormNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)

    def forward(self, x):
        return self.bn(self.lin(x))


def test_a_torch_task_says_buffers_are_constants_and_never_sent(tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="dpfedavg")
    cfg = _cfg(tmp_path, "bn")
    tasks = []

    def factory(c):
        tasks.append(_task(c, "cross_entropy", model=BatchNormNet))
        return tasks[-1]

    result = run(cfg, task=factory, progress=False)
    assert any("bn.running_mean" in r.getMessage() and "never sent" in r.getMessage() for r in caplog.records)
    module = tasks[-1].module
    assert result.weights.shape == (sum(p.numel() for p in module.parameters()),)  # parameters only
    np.testing.assert_array_equal(module.bn.running_mean.numpy(), 0.0)  # no client's data changed them
    np.testing.assert_array_equal(module.bn.running_var.numpy(), 1.0)


def test_dp_mod_sends_running_statistics_only_noised_and_says_so(caplog) -> None:
    """BatchNorm's statistics move on the client's data; what leaves is the clipped change plus noise of the
    client's share s = z C / sqrt(|S_k|), recomputed here from the state_dicts (and with z = 0 for the clean part)."""
    from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
    from test_app_strategy import _call, _train_message

    from dpfedavg.flower import arrays as arrays_module
    from dpfedavg.flower.protocol import UPDATE_KEY

    caplog.set_level(logging.WARNING, logger="dpfedavg")
    getattr(arrays_module, "_WARNED", set()).clear()
    torch.manual_seed(0)
    start = {k: v.detach().numpy().copy() for k, v in BatchNormNet().state_dict().items()}

    def train(m, context):  # one forward pass in train mode: the running statistics move to the client's data
        model = BatchNormNet()
        model.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
        model.train()
        model(torch.as_tensor(_data()[0]) * 3.0 + 2.0)
        out = ArrayRecord({k: Array(v.detach().numpy().copy()) for k, v in model.state_dict().items()})
        return Message(RecordDict({"arrays": out, "metrics": MetricRecord({"num-examples": 80})}), reply_to=m)

    def sent(z: float) -> np.ndarray:
        record = ArrayRecord({k: Array(v) for k, v in start.items()})
        reply = _call(_train_message(record, algorithm="clip", clip=1.0, noise_multiplier=z), train)
        assert list(reply.content["arrays"].keys()) == [UPDATE_KEY]  # one noised vector: no state_dict entry as is
        return reply.content["arrays"][UPDATE_KEY].numpy()

    noisy, clean = sent(1.0), sent(0.0)
    floats = sorted(k for k, v in start.items() if np.issubdtype(v.dtype, np.floating))
    model = BatchNormNet()
    model.load_state_dict({k: torch.as_tensor(v) for k, v in start.items()})
    model.train()
    model(torch.as_tensor(_data()[0]) * 3.0 + 2.0)
    after = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    u = np.concatenate([(start[k] - after[k]).ravel() for k in floats])  # running_mean/var inside, the counter not
    np.testing.assert_allclose(clean, u * min(1.0, 1.0 / np.linalg.norm(u)), rtol=1e-6)  # clipped to C = 1
    running = np.concatenate([np.full(start[k].size, k.startswith("bn.running")) for k in floats])
    assert running.sum() == 6 and np.all(np.abs(u[running]) > 1e-3)  # the statistics did move
    noise = noisy - clean
    s = 1.0 * 1.0 / np.sqrt(5)  # z C / sqrt(|S_k|): the client-calibrated share of round 2's 5 sampled clients
    assert np.all(noise[running] != 0) and 0.5 * s < noise.std() < 1.5 * s, (noise.std(), s)
    notes = [r.getMessage() for r in caplog.records if "buffers" in r.getMessage()]
    assert len(notes) == 1 and "bn.running_mean" in notes[0] and "noised" in notes[0], notes
    assert "bn.num_batches_tracked" in notes[0] and "never sent" in notes[0]


def test_log_axes_are_labelled_in_plain_text_with_matplotlibs_ticks() -> None:
    """io.log_axis writes matplotlib's own log labels without mathtext (whose parser dominated the figures' time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatterSciNotation

    from dpfedavg.io.log_axis import plain_log_labels, plain_text

    assert plain_text(r"$\mathdefault{10^{-2}}$") == "10⁻²"
    assert plain_text(r"$\mathdefault{2\times10^{-13}}$") == "2×10⁻¹³"
    assert plain_text(r"$\mathdefault{-10^{3}}$") == "−10³"
    assert plain_text(r"$\mathdefault{\alpha}$") == r"$\mathdefault{\alpha}$"  # not translatable: left as it was
    assert plain_text("") == "" and plain_text("1e-05") == "1e-05"
    labels = {}
    for name in ("mathtext", "plain"):
        fig, ax = plt.subplots()
        ax.set_yscale("log")
        ax.set_ylim(0.03, 0.7)  # under two decades: matplotlib labels minor ticks too
        ax.plot([0, 1], [0.05, 0.5])
        if name == "plain":
            plain_log_labels(ax)
        else:
            assert isinstance(ax.yaxis.get_major_formatter(), LogFormatterSciNotation)
        fig.canvas.draw()
        labels[name] = [t.get_text() for t in ax.yaxis.get_majorticklabels() + ax.yaxis.get_minorticklabels()]
        plt.close(fig)
    assert [plain_text(t) for t in labels["mathtext"]] == labels["plain"]
    assert "2×10⁻¹" in labels["plain"] and not any("$" in t for t in labels["plain"])
