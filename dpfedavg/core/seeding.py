"""Deterministic random streams derived from the run's single ``seed``.

Every random draw of a run comes from ``numpy.random.SeedSequence`` entropy
``[seed, stream, *keys]``; a stream is a fixed small integer so that, e.g.,
the noise client ``i`` adds in round ``k`` is the same on every engine
(Flower, batched, the plain-numpy reference in the tests) and in both the
``clip`` and the ``norm`` run of the same seed (paper §4.4 uses the same noise
vectors for both). Stateless derivation also makes resuming a run trivial.
"""

from __future__ import annotations

import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from enum import IntEnum
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["SECURE_NOISE_SEED", "RoundStreams", "Stream", "make_rng", "noise_rng", "round_noise_seed", "secure_rng"]

#: ``noise-seed`` the server sends with ``secure-noise = true``: "draw your noise from the OS CSPRNG".
SECURE_NOISE_SEED = -1


class Stream(IntEnum):
    """Independent random streams of a run."""

    TASK = 0  #: task data (e.g. the quadratic's A_i, w_i*), keyed by client
    INIT = 1  #: the initial point w_0
    SAMPLING = 2  #: Poisson client sampling, keyed by round
    NOISE = 3  #: per-round noise seeds, keyed by round
    ITERATE = 4  #: the random output iterate k~ (Alg. 1 line 13), keyed by round
    SERVER_NOISE = 5  #: noise the server adds (noise-placement = server), keyed by round
    MINIBATCH = 6  #: local mini-batches of torch tasks (local-batch-size > 0), keyed by client and round
    CANARY = 7  #: the audit's canary directions and which of them are inserted (canary-clients > 0)


def make_rng(seed: int, stream: Stream, *keys: int) -> np.random.Generator:
    """A fresh generator for ``(seed, stream, *keys)``."""
    return np.random.default_rng(np.random.SeedSequence([int(seed), int(stream), *map(int, keys)]))


@lru_cache(maxsize=8192)
def _initial_state(seed: int, stream: Stream, round_index: int) -> dict:
    """``make_rng(seed, stream, round_index)``'s bit-generator state (shared by the runs of a batch with one seed)."""
    return make_rng(seed, stream, round_index).bit_generator.state


#: `RoundStreams.draw()`'s values by ``(seed, stream, k, key)``, oldest first, with their sizes in bytes. Only the
#: runs of one round share a draw (a batch's runs call `draw()` for the same round one after the other), so a few
#: entries suffice: at most `_MAX_DRAWS` of them and `_MAX_DRAW_BYTES` of arrays (a cohort of every one of
#: 50,000 clients is 400 kB).
_draws: OrderedDict[tuple, tuple[Any, int]] = OrderedDict()
_MAX_DRAWS = 256
_MAX_DRAW_BYTES = 16 * 2**20
_draw_bytes = 0
_draws_lock = threading.Lock()


class RoundStreams:
    """A seeded run's per-round generators, ``make_rng(seed, stream, k)``, without building one per call.

    A server draws from three streams every round (sampling, the random iterate, its noise). Building a
    generator hashes a ``SeedSequence`` and seeds ``PCG64`` (about 7 us); the runs of a sweep's batch share
    their seed, so each ``(seed, stream, k)``'s initial state is computed once per process (cached) and set on a
    generator this object keeps per stream (under 1 us). The values drawn are the same, bit for bit.

    The generator `rng()` returns is reused by the next call for the same stream: draw from it at once.
    """

    def __init__(self, seed: int) -> None:
        self.seed = int(seed)
        self._generators: dict[Stream, np.random.Generator] = {}

    def rng(self, stream: Stream, round_index: int) -> np.random.Generator:
        """The generator of ``make_rng(seed, stream, round_index)``, at its start."""
        generator = self._generators.get(stream)
        if generator is None:
            generator = self._generators[stream] = np.random.Generator(np.random.PCG64(0))
        generator.bit_generator.state = _initial_state(self.seed, stream, int(round_index))
        return generator

    def draw(self, stream: Stream, round_index: int, key: Hashable, fn: Callable[[np.random.Generator], Any]) -> Any:
        """``fn(rng(stream, round_index))``, computed once per process for ``(seed, stream, round_index, key)``.

        For a draw that only the generator and ``key`` determine (a Poisson sample of ``n`` clients at ``q``,
        the random iterate's coin): the runs of a batch with one seed get the same value without drawing it
        again. An array comes back read-only (it is shared).
        """
        global _draw_bytes
        full = (self.seed, int(stream), int(round_index), key)
        hit = _draws.get(full)
        if hit is not None:
            return hit[0]
        value = fn(self.rng(stream, round_index))
        size = 0
        if isinstance(value, np.ndarray):
            value.flags.writeable = False
            size = value.nbytes
        with _draws_lock:  # servers in several threads of a process (the draw itself is deterministic)
            if full not in _draws:
                _draws[full] = (value, size)
                _draw_bytes += size
            while _draws and (len(_draws) > _MAX_DRAWS or _draw_bytes > _MAX_DRAW_BYTES):
                _draw_bytes -= _draws.popitem(last=False)[1][1]
        return value


@lru_cache(maxsize=4096)
def round_noise_seed(seed: int, round_index: int) -> int:
    """The per-round noise seed the server sends to the sampled clients.

    A client draws its noise from ``make_rng(noise_seed, Stream.NOISE, client_id)``.
    In this seeded (research) mode anyone who knows ``seed`` can regenerate
    the noise; see the documentation's privacy page. Cached: the runs of a sweep's batch share it.
    """
    rng = make_rng(seed, Stream.NOISE, round_index)
    return int(rng.integers(0, 2**63 - 1))


def secure_rng() -> np.random.Generator:
    """A generator seeded with 128 bits from the operating system's CSPRNG (``secrets``).

    Nobody, the server included, can regenerate what it draws. The Gaussian
    samples themselves come from numpy's PCG64 generator and floating-point
    arithmetic, which is not a cryptographic sampler (see the documentation's privacy page).
    """
    return np.random.default_rng(np.random.SeedSequence(secrets.randbits(128)))


def noise_rng(noise_seed: int, client_id: int) -> np.random.Generator:
    """Client ``client_id``'s noise generator for a round (Alg. 1 line 10).

    Seeded mode: ``make_rng(noise_seed, Stream.NOISE, client_id)``, the same on
    every engine. ``noise_seed == SECURE_NOISE_SEED`` (``secure-noise = true``):
    `secure_rng()`.
    """
    if noise_seed == SECURE_NOISE_SEED:
        return secure_rng()
    return make_rng(noise_seed, Stream.NOISE, client_id)
