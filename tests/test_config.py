"""Run config: defaults agree with pyproject.toml, bad input gets one clear error."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from dpfedavg.config import OPTIONS, ConfigError, RunConfig

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _app_config() -> dict:
    return tomllib.loads(PYPROJECT.read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_defaults_equal_the_dataclass_defaults() -> None:
    from_toml = RunConfig.from_run_config(_app_config(), allow_missing=False)
    assert from_toml == RunConfig()
    assert set(_app_config()) == {opt.key for opt in OPTIONS}


def test_every_pyproject_key_has_a_comment_naming_its_meaning() -> None:
    section = PYPROJECT.read_text().split("[tool.flwr.app.config]")[1].splitlines()
    checked = 0
    for line in section:
        if line.startswith("["):
            break
        if "=" in line:
            assert "#" in line, f"config line without a comment: {line}"
            checked += 1
    assert checked == len(OPTIONS)


def test_default_run_is_calibrated_to_epsilon_5_delta_1e6() -> None:
    """The default run: z calibrated by PLD for (5, 1e-6) over K = 200 rounds at q = 1."""
    from dpfedavg import epsilon_for
    from dpfedavg.privacy.setup import PrivacySetup

    cfg = RunConfig()
    plan = PrivacySetup.resolve(cfg).plan
    assert plan.calibrated and (plan.target_epsilon, plan.delta, plan.accountant) == (5.0, 1e-6, "pld")
    assert plan.nominal_epsilon <= 5.0
    assert epsilon_for(plan.noise_multiplier * 0.99, 1.0, cfg.num_rounds, 1e-6, "pld") > 5.0
    assert plan.noise_multiplier == pytest.approx(13.86, rel=2e-3)  # the value quoted in the README


def test_types_are_coerced_and_sentinels_mean_none() -> None:
    cfg = RunConfig.from_run_config({"clip": 40, "server-lr": "eta", "clients-per-round": 20})
    assert cfg.clip == 40.0 and isinstance(cfg.clip, float)
    assert cfg.server_lr is None and cfg.noise_multiplier is None
    assert RunConfig.from_run_config({"noise-multiplier": 2, "epsilon": 0.0}).noise_multiplier == 2.0
    assert RunConfig.from_run_config({"server-lr": 0.5}).server_lr == 0.5
    assert cfg.to_run_config()["server-lr"] == "eta"


@pytest.mark.parametrize(
    ("overrides", "fragments"),
    [
        ({"algorithm": "clipp"}, ["'algorithm' = 'clipp'", "'clip', 'norm', 'none'", "did you mean 'clip'"]),
        ({"clip": 0.0}, ["'clip' = 0.0", "a float > 0"]),
        ({"clip": -3}, ["'clip' = -3.0", "a float > 0"]),
        ({"clients-per-round": 101.0}, ["'clients-per-round' = 101", "0 < r <= n"]),
        ({"clients-per-round": 0.0}, ["'clients-per-round' = 0.0", "0 < r <= num-clients"]),
        ({"clients-per-round": -5.0}, ["'clients-per-round' = -5.0"]),
        ({"local-steps": 0}, ["'local-steps' = 0", "an integer >= 1"]),
        ({"local-steps": 2.5}, ["'local-steps' = 2.5", "an integer >= 1"]),
        ({"local-lr": -0.1}, ["'local-lr' = -0.1", "a float > 0"]),
        ({"server-lr": -1.0}, ["'server-lr' = -1.0", 'a float > 0 or "eta"']),
        ({"server-lr": "beta"}, ["'server-lr' = 'beta'"]),
        ({"lr-decay": 1.5}, ["'lr-decay' = 1.5", "(0, 1]"]),
        ({"server-momentum": 1.0}, ["'server-momentum' = 1.0", "[0, 1)"]),
        ({"noise-multiplier": -1.0, "epsilon": 0.0}, ["'noise-multiplier' = -1.0", "a negative value"]),
        ({"noise-multiplier": "automatic"}, ["'noise-multiplier' = 'automatic'", '"auto"']),
        ({"noise-multiplier": 1.0}, ["'epsilon' = 5 and 'noise-multiplier' = 1 are both set", "epsilon=0"]),
        ({"delta": 0.0}, ["'delta' = 0.0", "[1e-12, 0.1]"]),
        ({"delta": 1.0}, ["'delta' = 1.0", "[1e-12, 0.1]"]),
        ({"epsilon": -1.0}, ["'epsilon' = -1.0", ">= 0"]),
        ({"max-epsilon": -2.0}, ["'max-epsilon' = -2.0"]),
        ({"accountant": "moments"}, ["'accountant' = 'moments'", "'pld', 'rdp'"]),
        ({"noise-placement": "clients"}, ["'noise-placement' = 'clients'", "did you mean 'client'"]),
        ({"num-rounds": 0}, ["'num-rounds' = 0"]),
        ({"seed": -1}, ["'seed' = -1"]),
        ({"init": "I3"}, ["'init' = 'I3'", "'I1', 'I2'"]),
        ({"diagnostics": "yes"}, ["'diagnostics' = 'yes'", "true or false"]),
        ({"run-name": "../escape"}, ["'run-name' = '../escape'"]),
        ({"nois-multiplier": 1.0}, ["unknown key 'nois-multiplier'", "did you mean 'noise-multiplier'"]),
    ],
)
def test_bad_input_names_key_value_and_what_is_allowed(overrides: dict, fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config(overrides)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message


def test_all_errors_are_reported_in_one_message() -> None:
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config({"clip": 0.0, "local-steps": 0, "algorithm": "x"})
    message = str(info.value)
    assert message.count(";") == 2
    assert "'clip'" in message and "'local-steps'" in message and "'algorithm'" in message


def test_missing_keys_rejected_when_required() -> None:
    with pytest.raises(ConfigError, match="missing key 'seed'"):
        RunConfig.from_run_config({k: v for k, v in _app_config().items() if k != "seed"}, allow_missing=False)


def test_replace_validates() -> None:
    cfg = RunConfig().replace(num_clients=10, clients_per_round=5.0)
    assert cfg.sampling_rate == 0.5
    with pytest.raises(ConfigError):
        cfg.replace(clients_per_round=11.0)


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.key)
def test_every_key_rejects_a_wrong_type_naming_key_and_allowed(opt) -> None:
    """Each key family (numbers, flags, names, paths) refuses a value of the wrong type, before anything starts."""
    wrong = "not-a-number" if opt.kind in (int, float) else (3 if opt.kind is str else "yes")
    with pytest.raises(ConfigError) as info:
        RunConfig.from_run_config({opt.key: wrong})
    message = str(info.value)
    assert f"'{opt.key}' = {wrong!r}" in message
    assert "expected" in message or "allowed values" in message


@pytest.mark.parametrize(
    ("overrides", "fragment"),
    [
        ({"checkpoint-every": -1}, "'checkpoint-every' = -1"),
        ({"eval-every": 0}, "'eval-every' = 0"),
        ({"round-timeout": 0.0}, "'round-timeout' = 0.0"),
        ({"node-wait-timeout": -5.0}, "'node-wait-timeout' = -5.0"),
        ({"weight-decay": -1e-4}, "'weight-decay' = -0.0001"),
        ({"feature-image-size": 16}, "'feature-image-size' = 16"),
        ({"dim": 0}, "'dim' = 0"),
        ({"num-clients": 0}, "'num-clients' = 0"),
        ({"output-dir": " "}, "'output-dir' = ' '"),
        ({"resume": True}, "'resume' = True needs 'run-name'"),
        ({"delta": float("nan")}, "'delta' = nan"),
        ({"clip": float("inf")}, "'clip' = inf"),
    ],
)
def test_ranges_of_the_remaining_keys(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(fragment)):
        RunConfig.from_run_config(overrides)


def test_rules_come_from_the_registries_so_their_messages_list_what_is_allowed() -> None:
    """The secure-aggregation rules name every private bound and every placement whose clients add noise."""
    from dpfedavg.core.dp import BOUNDS
    from dpfedavg.core.mechanism import PLACEMENTS

    with pytest.raises(ConfigError) as info:
        RunConfig(secure_aggregation=True, algorithm="none", noise_placement="server", num_clients=10,
                  clients_per_round=10.0)  # fmt: skip
    message = str(info.value)
    private = [name for name, bound in BOUNDS.items() if bound.private]
    assert "adaptive-clip" in private and f"allowed: {', '.join(map(repr, private))}" in message
    noisy = [name for name, placement in PLACEMENTS.items() if placement.adds_client_noise]
    assert f"allowed: {', '.join(map(repr, noisy))}" in message
    RunConfig(secure_aggregation=True, algorithm="adaptive-clip", num_clients=10, clients_per_round=10.0)
