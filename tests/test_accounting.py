"""Accountants and calibration, checked against independent implementations (Opacus' RDP) and each other."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpfedavg import ConfigError, RunConfig, calibrate_noise_multiplier, epsilon_for
from dpfedavg.privacy.accountants import ACCOUNTANTS, RoundEvent, create_accountant
from dpfedavg.privacy.setup import PrivacySetup


@pytest.mark.parametrize(
    ("epsilon", "delta", "q", "rounds", "kind"),
    [
        (5.0, 1e-6, 1.0, 200, "pld"),  # the default quadratic run
        (5.0, 1e-5, 0.2, 100, "pld"),  # FMNIST-like, eps = 5
        (1.5, 1e-5, 0.2, 100, "rdp"),  # FMNIST-like, eps = 1.5
        (2.0, 1e-5, 0.05, 50, "rdp"),
    ],
)
def test_calibration_round_trip(epsilon: float, delta: float, q: float, rounds: int, kind: str) -> None:
    z = calibrate_noise_multiplier(epsilon, delta, q, rounds, kind)
    assert epsilon_for(z, q, rounds, delta, kind) <= epsilon
    assert epsilon_for(0.99 * z, q, rounds, delta, kind) > epsilon


def test_epsilon_is_monotone_in_rounds_and_in_q() -> None:
    for kind in ACCOUNTANTS:
        acc = create_accountant(kind, 1e-5)
        eps = []
        for _ in range(30):
            acc.step(RoundEvent(0.2, 1.5))
            eps.append(acc.epsilon)
        assert all(b > a for a, b in zip(eps, eps[1:], strict=False)), kind
        by_q = [epsilon_for(1.5, q, 20, 1e-5, kind) for q in (0.01, 0.05, 0.2, 0.5, 1.0)]
        assert all(b > a for a, b in zip(by_q, by_q[1:], strict=False)), kind


def test_pld_is_tighter_than_rdp() -> None:
    for q, z, k in [(0.2, 1.0, 100), (1.0, 13.86, 200), (0.01, 0.8, 1000)]:
        assert epsilon_for(z, q, k, 1e-5, "pld") < epsilon_for(z, q, k, 1e-5, "rdp")


@pytest.mark.parametrize(
    ("q", "z", "steps", "delta"), [(0.2, 1.0, 100, 1e-5), (0.01, 1.1, 1000, 1e-5), (1.0, 13.86, 200, 1e-6)]
)
def test_rdp_agrees_with_opacus_within_5_percent(q: float, z: float, steps: int, delta: float) -> None:
    """An independent implementation: Opacus' RDP accountant (same orders as dp-accounting's default)."""
    from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent

    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 64)) + [128, 256, 512, 1024]
    eps_opacus, _ = get_privacy_spent(
        orders=orders, rdp=compute_rdp(q=q, noise_multiplier=z, steps=steps, orders=orders), delta=delta
    )
    ours = epsilon_for(z, q, steps, delta, "rdp")
    assert ours == pytest.approx(float(eps_opacus), rel=0.05)


def test_accountant_rebuilds_from_its_state_and_peeks_without_composing() -> None:
    for kind in ACCOUNTANTS:
        acc = create_accountant(kind, 1e-5)
        for z in (1.0, 1.0, 0.8, None, 1.0, 1.2):
            acc.step(RoundEvent(0.3, z))
        peek = acc.epsilon_after(RoundEvent(0.3, 1.0))
        assert acc.rounds == 6 and peek > acc.epsilon
        rebuilt = create_accountant(kind, 1e-5)
        rebuilt.load_state_dict(acc.state_dict())
        assert rebuilt.rounds == 6 and rebuilt.epsilon == pytest.approx(acc.epsilon, rel=1e-12)
        acc.step(RoundEvent(0.3, 1.0))
        assert acc.epsilon == pytest.approx(peek, rel=1e-12)
        other = next(name for name in ACCOUNTANTS if name != kind)
        with pytest.raises(ValueError, match="cannot load"):
            create_accountant(other, 1e-5).load_state_dict(acc.state_dict())


def test_no_noise_is_infinite_epsilon_and_empty_rounds_are_free() -> None:
    for kind in ACCOUNTANTS:
        acc = create_accountant(kind, 1e-5)
        acc.step(RoundEvent(0.5, None))
        assert acc.epsilon == 0.0
        acc.step(RoundEvent(0.5, 0.0))
        assert math.isinf(acc.epsilon)


def test_bad_privacy_parameters() -> None:
    with pytest.raises(ValueError, match=r"q must be in \[0, 1\]"):
        RoundEvent(1.2, 1.0)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        create_accountant("pld", 0.0)
    with pytest.raises(ValueError, match="unknown accountant 'gdp'"):
        create_accountant("gdp", 1e-5)
    with pytest.raises(ValueError, match="epsilon must be > 0"):
        calibrate_noise_multiplier(0.0, 1e-5, 0.1, 10, "pld")
    with pytest.raises(ConfigError, match="exceeded by the first round"):
        PrivacySetup.resolve(RunConfig(epsilon=0.0, noise_multiplier=0.5, num_rounds=50, max_epsilon=0.1)).plan
    with pytest.raises(ConfigError, match="adds no noise"):
        PrivacySetup.resolve(RunConfig(algorithm="none", max_epsilon=3.0)).plan


def test_private_tunings_selection_accountant_follows_the_same_protocol() -> None:
    """Its state rebuilds it, its peek equals composing, and it charges more than one trial alone."""
    from dpfedavg.privacy.selection import SelectionAccountant, TrialCount, trial_epsilon

    count = TrialCount("poisson", 5.0)
    acc = SelectionAccountant(1e-5, count)
    for z in (1.2, 1.2, 1.0):
        acc.step(RoundEvent(0.2, z))
    peek = acc.epsilon_after(RoundEvent(0.2, 1.2), 2)
    rebuilt = SelectionAccountant(1e-5, count)
    rebuilt.load_state_dict(acc.state_dict())
    assert rebuilt.epsilon == pytest.approx(acc.epsilon, rel=1e-12)
    acc.step(RoundEvent(0.2, 1.2), 2)
    assert acc.epsilon == pytest.approx(peek, rel=1e-12)
    uniform = SelectionAccountant(1e-5, count)
    uniform.step(RoundEvent(0.2, 1.2), 5)
    assert uniform.epsilon > trial_epsilon(1.2, 0.2, 5, 1e-5)  # selection is paid for
    with pytest.raises(ValueError, match="this accountant's is"):
        SelectionAccountant(1e-5, TrialCount("poisson", 7.0)).load_state_dict(acc.state_dict())


@pytest.mark.parametrize("std", [0.07, 0.4, 1.3, 40.0])
def test_gaussian_pld_vectorised_is_the_library_pld_bit_for_bit(std: float) -> None:
    """The q = 1 per-round PLD built over arrays equals dp_accounting's ``from_gaussian_mechanism`` exactly."""
    from dp_accounting.pld import privacy_loss_distribution as pld_lib

    from dpfedavg.privacy.accountants import PLD_DISCRETIZATION, _gaussian_pld

    ref = pld_lib.from_gaussian_mechanism(standard_deviation=std, value_discretization_interval=PLD_DISCRETIZATION)
    new = _gaussian_pld(std)
    epsilons = np.linspace(0.0, 50.0, 101)
    assert np.array_equal(ref.get_delta_for_epsilon(epsilons), new.get_delta_for_epsilon(epsilons))
    for delta in (1e-3, 1e-5, 1e-9):
        assert ref.get_epsilon_for_delta(delta) == new.get_epsilon_for_delta(delta)
