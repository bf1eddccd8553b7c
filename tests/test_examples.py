"""The example apps under examples/: a Flower quickstart-style PyTorch app without and with DP (the diff the page
docs/tutorials/flower-app.md shows), and a numpy-only app.

The fast tests run the apps' own ``main`` and ClientApps in this process (an in-process Grid); the slow one runs
the DP app with the real ``flwr run`` and Flower's per-run dependency installation on (``uv sync`` of the app's
dependencies, dpfedavg from a wheel built here, torch from the CPU wheel pip finds), from a copy outside the
repository, and checks what it printed: epsilon <= target (recomputed independently), the saved ``state_dict``
loads into the app's ``Net``, accuracy well above chance. The package tests build the sdist and the wheel and
check them as an index would (twine).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.common.config import get_fused_config_from_dir, parse_config_args

from dpfedavg import InProcessGrid
from dpfedavg.flower.app_strategy import AppDPFedAvg

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
PLAIN, PRIVATE = EXAMPLES / "quickstart-pytorch", EXAMPLES / "quickstart-pytorch-dp"
NUMPY = EXAMPLES / "quickstart-numpy-dp"
#: `uv sync` as Flower 1.41 runs it for each run (flwr/supercore/superexec/dependency_installer.py), in the app's
#: installed folder, into the environment UV_PROJECT_ENVIRONMENT names.
FLOWER_UV_SYNC = ["sync", "--no-install-project", "--no-install-package", "flwr", "--inexact"]
PAGE = ROOT / "docs" / "tutorials" / "flower-app.md"
INSTALL_PAGE = ROOT / "docs" / "getting-started" / "install.md"
#: The DP statement DPFedAvg prints at the end of a run.
STATEMENT = re.compile(
    r"\((?P<eps>[\d.]+), (?P<delta>[\de.+-]+)\)-DP for each client's whole data \(user level\) after "
    r"(?P<rounds>\d+) rounds; z=(?P<z>[\d.]+), q=(?P<q>[\d.]+)"
)


def _files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): p.read_text()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and "__pycache__" not in p.parts
        and p.suffix in (".py", ".toml", ".md")
        and p.name != "README.md"
    }


def changed_lines() -> list[str]:
    """The DP app's diff from the plain one: every added (+) and removed (-) line, file by file."""
    plain, private = _files(PLAIN), _files(PRIVATE)
    out = []
    for name in sorted(set(plain) | set(private)):
        diff = difflib.unified_diff(
            plain.get(name, "").splitlines(), private.get(name, "").splitlines(), n=0, lineterm=""
        )
        out += [line for line in diff if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    return out


def test_adding_dp_to_the_quickstart_changes_about_ten_lines_and_the_page_shows_them() -> None:
    """Flower's own wrapper needs +6/-2 lines on its quickstart; dpfedavg's diff stays within about 10, and the
    diff on the page is the real one."""
    lines = changed_lines()
    assert 0 < len(lines) <= 10, "\n".join(lines)
    assert any("dp_mod" in line for line in lines) and any("DPFedAvg(" in line for line in lines)
    assert _files(PLAIN)["pytorchexample/task.py"] == _files(PRIVATE)["pytorchexample/task.py"]  # same model/data
    block = PAGE.read_text().split("```diff\n", 1)[1].split("```", 1)[0]
    shown = [line for line in block.splitlines() if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert sorted(shown) == sorted(lines)


def test_the_pages_code_is_the_examples_code() -> None:
    """Each Python block of the page that names a file, and its TOML block, appear verbatim in the example."""
    from doc_blocks import page_blocks

    blocks = [b for b in page_blocks(PAGE) if "file" in b.attrs]
    assert blocks
    for block in blocks:
        assert block.source in (ROOT / block.attrs["file"]).read_text(), block.where
    toml = PAGE.read_text().split("```toml\n", 1)[1].split("```", 1)[0]
    assert toml in (NUMPY / "pyproject.toml").read_text()


@pytest.fixture
def example(monkeypatch):
    """Import an example's package from its folder (and forget it afterwards: two examples share a name)."""

    def load(folder: Path, package: str):
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            monkeypatch.delitem(sys.modules, name)
        monkeypatch.syspath_prepend(str(folder))
        return (importlib.import_module(f"{package}.{m}") for m in ("task", "client_app", "server_app"))

    yield load
    for name in [m for m in sys.modules if m.split(".")[0] in ("pytorchexample", "numpyexample")]:
        del sys.modules[name]


@pytest.fixture(autouse=True)
def _quick_start(monkeypatch) -> None:
    monkeypatch.setattr(AppDPFedAvg, "settle_seconds", 0.05)


@pytest.fixture
def one_torch_thread():
    """Tiny models: one thread is faster than a contended pool (as in a Ray worker with one CPU)."""
    torch = pytest.importorskip("torch")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield torch
    torch.set_num_threads(threads)


def _run_main(folder: Path, server_app, client_app, overrides: str, nodes: int) -> dict:
    run_config = get_fused_config_from_dir(folder, parse_config_args([overrides]))
    grid = InProcessGrid(client_app.app, nodes, run_config)
    server_app.main(grid, Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config))
    return run_config


def _statement(text: str) -> dict[str, float]:
    match = STATEMENT.search(text)
    assert match, f"no DP statement in the output:\n{text[-3000:]}"
    return {k: float(v) for k, v in match.groupdict().items()}


def _independent_epsilon(q: float, z: float, rounds: int, delta: float) -> tuple[float, float]:
    """(dp-accounting PLD at its default discretization, Opacus RDP) for the run's mechanism."""
    from dp_accounting import dp_event
    from dp_accounting.pld import pld_privacy_accountant
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    pld = pld_privacy_accountant.PLDAccountant()
    pld.compose(dp_event.PoissonSampledDpEvent(q, dp_event.GaussianDpEvent(z)), rounds)
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    rdp = compute_rdp(q=q, noise_multiplier=z, steps=rounds, orders=orders)
    return float(pld.get_epsilon(delta)), float(get_privacy_spent(orders=orders, rdp=rdp, delta=delta)[0])


def _check_epsilon(stated: dict[str, float], target: float) -> None:
    """The printed epsilon is at most the target and is the mechanism's: z, q and K printed beside it give it.

    z is printed to 5 significant digits; epsilon decreases in z, so the rounded z brackets it."""
    assert stated["eps"] <= target
    rounds, q, delta = int(stated["rounds"]), stated["q"], stated["delta"]
    z_low, z_high = stated["z"] * (1 - 1e-4), stated["z"] * (1 + 1e-4)
    pld_high, rdp = _independent_epsilon(q, z_low, rounds, delta)
    pld_low, _ = _independent_epsilon(q, z_high, rounds, delta)
    assert pld_low * (1 - 1e-3) <= stated["eps"] <= pld_high * (1 + 1e-3)  # printed to 4 digits
    assert stated["eps"] <= rdp  # Opacus' RDP: an independent, looser upper bound


def test_the_pytorch_dp_example_trains_in_process(example, tmp_path, dp_log, one_torch_thread) -> None:
    torch = one_torch_thread
    task, client_app, server_app = example(PRIVATE, "pytorchexample")
    model_path = tmp_path / "final_model.pt"
    _run_main(PRIVATE, server_app, client_app, f'num-server-rounds=3 model-path="{model_path}"', 10)
    _check_epsilon(_statement(dp_log.text), 8.0)
    net = task.Net()
    net.load_state_dict(torch.load(model_path))  # the user's state_dict, as FedAvg's Result gives it


def test_the_plain_example_is_a_working_flower_app(example, tmp_path, one_torch_thread) -> None:
    torch = one_torch_thread
    task, client_app, server_app = example(PLAIN, "pytorchexample")
    model_path = tmp_path / "final_model.pt"
    _run_main(PLAIN, server_app, client_app, f'num-server-rounds=2 model-path="{model_path}"', 4)
    task.Net().load_state_dict(torch.load(model_path))


def test_the_numpy_example_trains_privately_with_its_settings_in_the_dpfedavg_table(example, tmp_path, dp_log) -> None:
    task, client_app, server_app = example(NUMPY, "numpyexample")
    model_path = tmp_path / "final_model.npz"
    run_config = _run_main(NUMPY, server_app, client_app, f'model-path="{model_path}"', 20)
    assert run_config["dpfedavg.epsilon"] == 5.0 and run_config["num-server-rounds"] == 20
    _check_epsilon(_statement(dp_log.text), 5.0)
    model = np.load(model_path)
    x, y = task.load_data(partition_id=-1, num_examples=500)
    initial = task.mse(np.zeros(task.NUM_FEATURES), np.zeros(1), x, y)
    assert task.mse(model["w"], model["b"], x, y) < 0.5 * initial
    assert model["w"].dtype == np.float32 and model["b"].shape == (1,)


@pytest.mark.slow
def test_the_dp_example_with_flwr_run(tmp_path: Path, uv_find_links: str) -> None:
    """The page's and the example README's command: flwr run on a copy of examples/quickstart-pytorch-dp outside
    the repository, 20 SuperNodes (Ray simulation), with Flower's per-run dependency installation on: its
    `uv sync` installs dpfedavg from the wheel UV_FIND_LINKS points at (and torch from the CPU wheel pip finds)."""
    torch = pytest.importorskip("torch")
    from dpfedavg.engines.local_superlink import LocalSuperLink

    app = _copy_outside(PRIVATE, tmp_path)
    model_path = tmp_path / "final_model.pt"
    with LocalSuperLink(tmp_path / "superlink", runtime_dependency_install=True) as link:
        assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION" not in link.env
        assert link.env["UV_FIND_LINKS"] == uv_find_links
        result = link.flwr_run(f'model-path="{model_path}"', "num-supernodes=20 client-resources-num-cpus=1", app=app)
        leftover = link
    assert leftover.leftover_pids() == []
    out = result.stdout
    assert "Traceback" not in out and model_path.exists(), out[-4000:]  # flwr run exits 0 even when the app fails
    installed = re.search(r"Installed: \[(.*)\]", out)  # Flower's log of what its `uv sync` put in the run's env
    assert installed and "App dependencies installed successfully via uv sync" in out, out[-4000:]
    assert re.search(r"\bdpfedavg==", installed.group(1)), installed.group(1)
    if _local_cpu_torch(uv_find_links):
        assert "torch==2.13.0+cpu" in installed.group(1) and "nvidia" not in installed.group(1)
    stated = _statement(out)
    assert int(stated["rounds"]) == 15
    _check_epsilon(stated, 8.0)
    sys.path.insert(0, str(PRIVATE))
    try:
        from pytorchexample.task import Net, load_centralized_dataset, test

        net = Net()
        net.load_state_dict(torch.load(model_path))
        _, accuracy = test(net, load_centralized_dataset(), torch.device("cpu"))
    finally:
        sys.path.remove(str(PRIVATE))
        for name in [m for m in sys.modules if m.split(".")[0] == "pytorchexample"]:
            del sys.modules[name]
    assert accuracy > 0.3, accuracy  # 10 classes: chance is 0.1


# --- Installing the examples the way Flower installs an app's dependencies -----------------------------------------


def _pip_find_links() -> list[str]:
    """The folders pip finds wheels in besides its indexes (PIP_FIND_LINKS, pip's configuration files).

    uv reads neither: on a machine whose CPU torch wheel is found this way, uv must be pointed at it too."""
    found = os.environ.get("PIP_FIND_LINKS", "").split()
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            found += value.strip().strip("'\"").split()
    return list(dict.fromkeys(found))


@functools.cache
def _registry_reachable() -> bool:
    try:
        with urllib.request.urlopen("https://pypi.org/simple/pip/", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def dpfedavg_dist(tmp_path_factory) -> Path:
    """dpfedavg built (sdist, then the wheel from it) into a folder of its own, with the uv that comes with Flower:
    what a user does before the package is on an index."""
    out = tmp_path_factory.mktemp("dist")
    subprocess.run(
        [sys.executable, "-m", "uv", "build", "--out-dir", str(out), str(ROOT)], check=True, capture_output=True
    )
    return out


@pytest.fixture
def uv_find_links(dpfedavg_dist, monkeypatch) -> str:
    """UV_FIND_LINKS as the example's README says: the wheel's folder, then where pip finds wheels here."""
    if not _registry_reachable():
        pytest.skip("the package registry (pypi.org) is not reachable: Flower's per-run install needs it")
    value = ",".join([str(dpfedavg_dist), *_pip_find_links()])
    monkeypatch.setenv("UV_FIND_LINKS", value)
    return value


def _copy_outside(folder: Path, tmp_path: Path) -> Path:
    """The example as a user has it: a folder of its own, away from this repository."""
    app = tmp_path / folder.name
    shutil.copytree(folder, app, ignore=shutil.ignore_patterns("__pycache__", "uv.lock", ".venv"))
    return app


def _local_cpu_torch(find_links: str) -> bool:
    return any(Path(d).is_dir() and any(Path(d).glob("torch-*+cpu-*.whl")) for d in find_links.split(","))


@pytest.mark.parametrize("folder", [PRIVATE, NUMPY], ids=lambda f: f.name)
def test_the_dp_examples_install_the_way_flower_installs_apps(folder, tmp_path, uv_find_links) -> None:
    """Flower's per-run `uv sync` of the example resolves: dpfedavg from the wheel built as
    docs/getting-started/install.md says, torch from the CPU wheel where pip has one (never the CUDA packages on a
    machine without a GPU). A dry run: nothing is downloaded."""
    app = _copy_outside(folder, tmp_path)
    env = {**os.environ, "UV_PROJECT_ENVIRONMENT": str(tmp_path / "runtime-env")}
    command = [sys.executable, "-m", "uv", *FLOWER_UV_SYNC, "--python", sys.executable, "--dry-run"]
    done = subprocess.run(command, cwd=app, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    planned = dict(line.strip()[2:].split("==", 1) for line in out.splitlines() if line.strip().startswith("+ "))
    assert planned["dpfedavg"] == tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"], out
    assert "flwr" not in planned  # Flower keeps its own installation
    if folder is PRIVATE and _local_cpu_torch(uv_find_links):
        assert planned["torch"].endswith("+cpu") and not any(n.startswith("nvidia") for n in planned), out
    page = INSTALL_PAGE.read_text()
    assert page.split("```toml\n", 1)[1].split("```", 1)[0] in (PRIVATE / "pyproject.toml").read_text()


def test_the_package_is_ready_to_publish(dpfedavg_dist: Path) -> None:
    """sdist and wheel build, pass twine's check (what an index checks), carry the metadata and classifiers, and
    the version is pyproject's, the one dpfedavg.__version__ reports."""
    import dpfedavg

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = dpfedavg_dist
    built = sorted(p.name for p in out.iterdir() if p.suffix in (".whl", ".gz"))
    version = project["version"]
    assert built == [f"dpfedavg-{version}-py3-none-any.whl", f"dpfedavg-{version}.tar.gz"]
    check = subprocess.run(
        [sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(out.glob("dpfedavg-*")))],
        capture_output=True,
        text=True,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    with zipfile.ZipFile(out / built[0]) as wheel:
        metadata = wheel.read(f"dpfedavg-{version}.dist-info/METADATA").decode()
        generator = wheel.read(f"dpfedavg-{version}.dist-info/WHEEL").decode()
        names = wheel.namelist()
    # the build backend is not capped: uv built it with the newest hatchling the index has, which by default writes
    # Metadata-Version 2.5 (twine 6 with the packaging < 26 that flwr pins cannot read it); pyproject asks for 2.4
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"] == ["hatchling>=1.27"]
    assert metadata.startswith("Metadata-Version: 2.4\n") and "Generator: hatchling " in generator
    with tarfile.open(out / built[1]) as sdist:
        pkg_info = sdist.extractfile(f"dpfedavg-{version}/PKG-INFO").read().decode()
    assert pkg_info.startswith("Metadata-Version: 2.4\n")
    for field in ("Summary", "License-Expression", "Requires-Python", "Author", "Keywords"):
        assert f"\n{field}: " in metadata, field
    assert metadata.count("\nClassifier: ") == len(project["classifiers"]) >= 8
    assert not any(n.startswith(("tests/", "examples/", "docs/")) for n in names)  # the library only
    assert dpfedavg.__version__ == version


@pytest.mark.parametrize("folder", sorted(p for p in EXAMPLES.iterdir() if p.is_dir()), ids=lambda f: f.name)
def test_every_example_has_a_readme_with_its_command(folder: Path) -> None:
    """What it shows, the one command (flwr run of this folder, with what Flower's per-run install needs), the
    expected last line, how long it takes, and for torch the CUDA/CPU choice; each shell block runs in a test
    here or says why not."""
    from doc_blocks import page_blocks

    readme = folder / "README.md"
    text = readme.read_text()
    for part in ("What it shows", "## Run it", "How long: ", "```text"):
        assert part in text, f"{readme}: no {part!r}"
    assert not re.search(r"\b(TIMING|LASTLINE)_", text), f"{readme}: a placeholder is left"
    shell = [b for b in page_blocks(readme) if b.is_shell]
    runs = [b for b in shell if f"cd examples/{folder.name}\nflwr run . --stream" in b.source]
    assert len(runs) == 1, f"{readme}: one block with the command"
    for block in shell:
        if block.kind == "run-by":
            assert f"def {block.attrs['test'].partition('::')[2]}(" in Path(__file__).read_text(), block.where
        else:
            assert block.kind == "no-test" and block.attrs.get("reason", "").strip(), block.where
    dependencies = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["dependencies"]
    if any(d.startswith("dpfedavg") for d in dependencies):
        assert 'uv build --out-dir dist\nexport UV_FIND_LINKS="$PWD/dist"\n' in runs[0].source
        last = text.split("```text\n", 1)[1].split("\n", 1)[0]
        assert STATEMENT.search(last), last
    if any(d.startswith("torch") for d in dependencies):
        assert "CUDA build" in text and "UV_FIND_LINKS" in text and "2.13.0+cpu" in text
