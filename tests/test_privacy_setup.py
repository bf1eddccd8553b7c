"""The privacy set-up is resolved once per run, and every registry is read through its one lookup function.

`PrivacySetup.resolve` is spied on (monkeypatch) while each entry point runs a small quadratic: the batched engine
(the Python API), a sweep's batch, the in-process Flower simulation (the ServerApp's ``main`` on `InProcessGrid`)
and the app strategy (`DPFedAvg` with `dp_mod`). A scan of ``dpfedavg/`` (its AST) fails if a module indexes a
registry outside the module that defines it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from dpfedavg import DPFedAvg, InProcessGrid, RunConfig, dp_mod, run
from dpfedavg.core.dp import BOUNDS, get_bound, is_private_algorithm
from dpfedavg.core.mechanism import PLACEMENTS, get_placement
from dpfedavg.errors import ConfigError
from dpfedavg.privacy.accountants import ACCOUNTANTS, accountant_class
from dpfedavg.privacy.noise_mechanisms import NOISE_MECHANISMS, get_noise_mechanism
from dpfedavg.privacy.setup import FederationSize, PrivacySetup

BASE = {
    "task": "quadratic",
    "dim": 6,
    "num-clients": 6,
    "clients-per-round": 3.0,
    "num-rounds": 2,
    "local-steps": 2,
    "epsilon": 0.0,
    "noise-multiplier": 1.0,
    "delta": 1e-5,
    "clip": 1.0,
    "seed": 3,
    "checkpoint-every": 0,
}


def _cfg(tmp_path: Path, **overrides) -> RunConfig:
    return RunConfig.from_run_config({**BASE, "output-dir": str(tmp_path), "run-name": "run", **overrides})


@pytest.fixture
def resolved(monkeypatch) -> list[RunConfig]:
    """The configs `PrivacySetup.resolve` was called with, in order (the spy calls the real function)."""
    calls: list[RunConfig] = []
    real = PrivacySetup.resolve

    def spy(cls, cfg):
        calls.append(cfg)
        return real(cfg)

    monkeypatch.setattr(PrivacySetup, "resolve", classmethod(spy))
    return calls


# ------------------------------------------------------------------------------------ resolved once per run
@pytest.mark.parametrize("extra", [{}, {"canary-clients": 3}, {"algorithm": "adaptive-clip"}], ids=str)
def test_the_batched_engine_resolves_the_privacy_setup_once(tmp_path, resolved, extra) -> None:
    result = run(_cfg(tmp_path, **extra), progress=False)
    assert (result.directory / "model.npz").is_file()
    assert len(resolved) == 1


def test_a_sweeps_batch_resolves_each_runs_setup_once(tmp_path, resolved) -> None:
    from dpfedavg.engines.batched_runs import run_batch

    cfgs = [_cfg(tmp_path, **{"run-name": "clip"}), _cfg(tmp_path, algorithm="norm", **{"run-name": "norm"})]
    directories = run_batch(cfgs)
    assert all((d / "model.npz").is_file() for d in directories)
    assert [c.run_name for c in resolved] == ["clip", "norm"]


def test_the_flower_simulation_resolves_the_privacy_setup_once(tmp_path, resolved) -> None:
    from dpfedavg.flower import server_app
    from dpfedavg.flower.client_app import app as client_app

    cfg = _cfg(tmp_path, **{"canary-clients": 2})
    run_config = cfg.to_run_config()
    grid = InProcessGrid(client_app, cfg.num_clients, run_config)
    server_app.main(grid, Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config=run_config))
    assert (tmp_path / "run" / "model.npz").is_file()
    assert len(resolved) == 1


def _train(msg: Message, context: Context) -> Message:
    """A user's numpy client: one gradient step towards its own point."""
    w = msg.content["arrays"]["w"].numpy()
    target = np.full_like(w, float(context.node_config["partition-id"]))
    new = w - 0.5 * (w - target)
    metrics = MetricRecord({"num-examples": 1})
    return Message(RecordDict({"arrays": ArrayRecord({"w": Array(new)}), "metrics": metrics}), reply_to=msg)


def test_the_app_strategy_resolves_the_privacy_setup_once(resolved) -> None:
    client = ClientApp()
    client.train(mods=[dp_mod])(_train)
    strategy = DPFedAvg(
        algorithm="clip", clip=0.5, epsilon=0.0, noise_multiplier=1.0, clients_per_round=3.0, num_clients=6, seed=3
    )
    strategy.start(
        grid=InProcessGrid(client, 6, {}),
        initial_arrays=ArrayRecord({"w": Array(np.zeros(4))}),
        num_rounds=2,
        train_config=ConfigRecord({}),
    )
    assert len(resolved) == 1
    assert strategy.server.setup is not None and strategy.server.setup.plan is strategy.plan


# --------------------------------------------------------------------------------------------- the set-up
def test_the_canary_federation_is_n_plus_the_inserted_canaries_at_the_same_q(tmp_path) -> None:
    from dpfedavg.privacy.canary import CanarySet

    cfg = _cfg(tmp_path, **{"num-clients": 100, "clients-per-round": 10.0, "canary-clients": 40, "seed": 11})
    setup = PrivacySetup.resolve(cfg)
    inserted = CanarySet.draw(cfg.seed, cfg.canary_clients, cfg.dim).num_inserted  # what the engines insert
    assert 0 < inserted < 40 and setup.federation == FederationSize(100, 10.0, inserted)
    assert setup.federation.sampled_clients == setup.params.num_clients == 100 + inserted
    assert setup.params.clients_per_round == pytest.approx(10.0 * (100 + inserted) / 100, rel=1e-15)
    assert setup.params.q == pytest.approx(0.1, rel=1e-15) and setup.plan.q == pytest.approx(0.1, rel=1e-15)
    alone = PrivacySetup.resolve(cfg.replace(canary_clients=0))
    assert alone.federation.sampled == (100, 10.0)
    assert setup.plan.noise_multiplier == alone.plan.noise_multiplier  # z and epsilon: the run's without canaries
    assert setup.plan.nominal_epsilon == alone.plan.nominal_epsilon


def test_the_setup_holds_the_objects_its_config_names(tmp_path) -> None:
    cfg = _cfg(tmp_path, algorithm="adaptive-clip", **{"noise-placement": "server", "clip-count-stddev": 2.0})
    setup = PrivacySetup.resolve(cfg)
    assert (setup.bound.name, setup.placement.name, setup.noise_mechanism.name) == (
        "adaptive-clip",
        "server",
        "independent",
    )
    assert setup.noise_law.name == "gaussian" and setup.secagg is None
    assert setup.adaptive is not None and (setup.adaptive.clip, setup.adaptive.count_stddev) == (1.0, 2.0)
    assert setup.plan.params is setup.params and setup.plan.noise_mechanism is setup.noise_mechanism


# ------------------------------------------------------------------------------------------- the registries
@pytest.mark.parametrize(
    ("lookup", "registry", "key"),
    [
        (get_bound, BOUNDS, "algorithm"),
        (get_placement, PLACEMENTS, "noise-placement"),
        (get_noise_mechanism, NOISE_MECHANISMS, "noise-mechanism"),
        (accountant_class, ACCOUNTANTS, "accountant"),
    ],
)
def test_each_lookup_names_the_key_the_value_and_the_allowed_values(lookup, registry, key) -> None:
    with pytest.raises(ConfigError) as info:
        lookup("no-such-name")
    message = str(info.value)
    assert f"'{key}' = 'no-such-name'" in message, message
    assert message.endswith("allowed: " + ", ".join(f"'{name}'" for name in registry)), message
    for name, value in registry.items():
        assert lookup(name) is value


def test_an_unknown_algorithm_is_not_private() -> None:
    assert [is_private_algorithm(name) for name in BOUNDS] == [bound.private for bound in BOUNDS.values()]
    assert not is_private_algorithm("clipp") and not is_private_algorithm("")


ROOT = Path(__file__).resolve().parents[1]
#: registry -> the module that defines it and alone may index it (its lookup function lives there).
REGISTRIES = {
    "BOUNDS": "dpfedavg/core/dp.py",
    "PLACEMENTS": "dpfedavg/core/mechanism.py",
    "NOISE_LAWS": "dpfedavg/core/noise.py",
    "NOISE_MECHANISMS": "dpfedavg/privacy/noise_mechanisms.py",
    "ACCOUNTANTS": "dpfedavg/privacy/accountants.py",
    "TASKS": "dpfedavg/tasks/__init__.py",
}
#: Modules still indexing a registry, converted in a follow-up (each line is a lookup to replace).
NOT_YET_CONVERTED = {"dpfedavg/privacy/policy.py", "dpfedavg/privacy/ledger.py"}


def _registry_name(node: ast.AST) -> str | None:
    """``BOUNDS`` for the expressions ``BOUNDS`` and ``dp.BOUNDS``; ``None`` otherwise."""
    if isinstance(node, ast.Name) and node.id in REGISTRIES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in REGISTRIES:
        return node.attr
    return None


def registry_indexing(source: str) -> list[tuple[int, str]]:
    """``(line, registry)`` of every ``REG[x]``, ``REG.get(x)`` and ``x in REG`` / ``x not in REG`` in ``source``
    (iterating over a registry, to list its names, is not a lookup)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        name = None
        if isinstance(node, ast.Subscript):
            name = _registry_name(node.value)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
            name = _registry_name(node.func.value)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops):
            name = next((n for n in map(_registry_name, node.comparators) if n is not None), None)
        if name is not None:
            found.append((node.lineno, name))
    return found


def test_the_scan_finds_each_kind_of_registry_indexing() -> None:
    planted = "a = BOUNDS[x]\nb = core.PLACEMENTS.get(y)\nc = z in ACCOUNTANTS\nd = tuple(BOUNDS)\ne = w not in TASKS\n"
    assert registry_indexing(planted) == [(1, "BOUNDS"), (2, "PLACEMENTS"), (3, "ACCOUNTANTS"), (5, "TASKS")]


def test_no_module_indexes_a_registry_outside_its_own() -> None:
    offenders = []
    for path in sorted((ROOT / "dpfedavg").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel in NOT_YET_CONVERTED:
            continue
        for line, name in registry_indexing(path.read_text()):
            if REGISTRIES[name] != rel:
                offenders.append(f"{rel}:{line} indexes {name}")
    assert not offenders, "read a registry through its lookup function:\n" + "\n".join(offenders)
    converted = [rel for rel in sorted(NOT_YET_CONVERTED) if not registry_indexing((ROOT / rel).read_text())]
    assert not converted, f"{converted} index no registry any more: take them out of NOT_YET_CONVERTED"
