"""Deterministic random streams derived from the run's single ``seed``.

Every random draw of a run comes from ``numpy.random.SeedSequence`` entropy
``[seed, stream, *keys]``; a stream is a fixed small integer so that, e.g.,
the noise client ``i`` adds in round ``k`` is the same on every engine
(Flower, batched, the plain-numpy reference in the tests) and in both the
``clip`` and the ``norm`` run of the same seed (paper §4.4 uses the same noise
vectors for both). Stateless derivation also makes resuming a run trivial.
"""

from __future__ import annotations

from enum import IntEnum

import numpy as np

__all__ = ["Stream", "make_rng", "round_noise_seed"]


class Stream(IntEnum):
    """Independent random streams of a run."""

    TASK = 0  #: task data (e.g. the quadratic's A_i, w_i*), keyed by client
    INIT = 1  #: the initial point w_0
    SAMPLING = 2  #: Poisson client sampling, keyed by round
    NOISE = 3  #: per-round noise seeds, keyed by round
    ITERATE = 4  #: the random output iterate k~ (Alg. 1 line 13), keyed by round
    SERVER_NOISE = 5  #: noise the server adds (noise-placement = server), keyed by round


def make_rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A fresh generator for ``(seed, stream, *keys)``."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), *map(int, keys)]))


def round_noise_seed(seed: int, round_index: int) -> int:
    """The per-round noise seed the server sends to the sampled clients.

    A client draws its noise from ``make_rng(noise_seed, Stream.NOISE, client_id)``.
    In this seeded (research) mode anyone who knows ``seed`` can regenerate
    the noise; see the README's privacy notes.
    """
    rng = make_rng(seed, Stream.NOISE, round_index)
    return int(rng.integers(0, 2**63 - 1))
