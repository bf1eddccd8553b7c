"""Many clients' noise rows at once: numpy's ``SeedSequence`` and ``PCG64`` seeding done for a whole block.

Client ``i``'s noise in a round is ``make_rng(noise_seed, Stream.NOISE, i).standard_normal(d)``
(`dpfedavg.core.seeding.noise_rng()`, Alg. 1 line 10). Building that generator costs about 8 us of Python
and Cython per client (the ``SeedSequence``'s hash over its entropy words, ``PCG64``'s seeding), more than
drawing its ``d = 200`` values (2.5 us). For a block of clients the hash is the same arithmetic on
every client's words, so `fill_noise_rows()` runs it on numpy arrays over the block (the algorithm numpy
documents for ``SeedSequence``: ``mix_entropy`` and ``generate_state``, 32-bit words), seeds ``PCG64`` as
numpy does (``pcg_setseq_128_srandom_r``: two steps of the 128-bit LCG), sets each client's state on one
reused generator and draws its row: the same state, so the same values, bit for bit.

Every call checks its first client against the generator numpy builds (`noise_rng()`); if they ever
differed (a numpy whose seeding changed, an entropy this code does not cover) the block is drawn client by
client with `noise_rng()` instead, and a warning says so once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from dpfedavg.core.seeding import Stream, noise_rng

__all__ = ["fill_noise_rows"]

logger = logging.getLogger(__name__)

# numpy.random.SeedSequence's constants (numpy/random/bit_generator.pyx) and PCG64's 128-bit multiplier
_INIT_A, _MULT_A, _INIT_B, _MULT_B = 0x43B0D7E5, 0x931E8875, 0x8B51F9DD, 0x58F38DED
_MIX_MULT_L, _MIX_MULT_R, _XSHIFT, _MASK32 = 0xCA01F9DD, 0x4973F715, 16, 0xFFFFFFFF
_POOL_SIZE = 4
_PCG_MULT = (2549297995355413924 << 64) + 4865540595714422341
_MASK128 = (1 << 128) - 1

_warned = False


def _words(n: int) -> list[int]:
    """``SeedSequence``'s 32-bit words of a non-negative int, least significant first (``[0]`` for 0)."""
    if n == 0:
        return [0]
    out = []
    while n:
        out.append(n & _MASK32)
        n >>= 32
    return out


def _pools(prefix: list[int], last: np.ndarray) -> list[np.ndarray]:
    """``SeedSequence(prefix + [last_b]).pool`` for every ``b`` (entropy of at most the pool's 4 words)."""
    hash_const = _INIT_A

    def hashmix(value: np.ndarray) -> np.ndarray:
        nonlocal hash_const
        value = value ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_A) & _MASK32
        value = value * np.uint32(hash_const)
        return value ^ (value >> np.uint32(_XSHIFT))

    entropy = [np.full(len(last), word, dtype=np.uint32) for word in prefix] + [last]
    zero = np.zeros(len(last), dtype=np.uint32)
    mixer = [hashmix(entropy[i] if i < len(entropy) else zero) for i in range(_POOL_SIZE)]
    for src in range(_POOL_SIZE):
        for dst in range(_POOL_SIZE):
            if src != dst:
                mixed = np.uint32(_MIX_MULT_L) * mixer[dst] - np.uint32(_MIX_MULT_R) * hashmix(mixer[src])
                mixer[dst] = mixed ^ (mixed >> np.uint32(_XSHIFT))
    return mixer


def _pcg64_states(pool: list[np.ndarray]) -> list[tuple[int, int]]:
    """``PCG64(seed_sequence).state``'s ``(state, inc)`` from each pool: ``generate_state(4, uint64)``, then seeding."""
    hash_const, words = _INIT_B, []
    for i in range(2 * _POOL_SIZE):
        value = pool[i % _POOL_SIZE] ^ np.uint32(hash_const)
        hash_const = (hash_const * _MULT_B) & _MASK32
        value = value * np.uint32(hash_const)
        words.append((value ^ (value >> np.uint32(_XSHIFT))).astype(np.uint64))
    w = [(words[2 * k] | (words[2 * k + 1] << np.uint64(32))).tolist() for k in range(4)]
    states = []
    for hi_s, lo_s, hi_i, lo_i in zip(*w, strict=True):
        inc = ((((hi_i << 64) | lo_i) << 1) | 1) & _MASK128
        state = ((inc + ((hi_s << 64) | lo_s)) * _PCG_MULT + inc) & _MASK128  # step, add initstate, step
        states.append((state, inc))
    return states


def _state(state: int, inc: int) -> dict:
    return {"bit_generator": "PCG64", "state": {"state": state, "inc": inc}, "has_uint32": 0, "uinteger": 0}


def fill_noise_rows(noise_seed: int, client_ids: Sequence[int] | np.ndarray, out: np.ndarray, rows: range) -> None:
    """``out[b] = noise_rng(noise_seed, client_ids[b]).standard_normal(out.shape[1])`` for ``b`` in ``rows``."""
    global _warned
    if not len(rows):
        return
    ids = [int(client_ids[b]) for b in rows]
    fast = noise_seed >= 0 and all(0 <= i <= _MASK32 for i in ids)  # not SECURE_NOISE_SEED: the OS's entropy
    prefix = _words(noise_seed) + _words(int(Stream.NOISE)) if fast else []
    fast = fast and len(prefix) < _POOL_SIZE
    if fast:
        states = _pcg64_states(_pools(prefix, np.asarray(ids, dtype=np.uint32)))
        check = noise_rng(noise_seed, ids[0]).bit_generator.state
        fast = check == _state(*states[0])
        if not fast and not _warned:
            _warned = True
            logger.warning("numpy %s seeds PCG64 differently: noise rows are drawn client by client", np.__version__)
    if not fast:
        for b, i in zip(rows, ids, strict=True):
            noise_rng(noise_seed, i).standard_normal(out.shape[1], out=out[b])
        return
    bit_generator = np.random.PCG64(0)
    generator = np.random.Generator(bit_generator)
    for b, state in zip(rows, states, strict=True):
        bit_generator.state = _state(*state)
        generator.standard_normal(out.shape[1], out=out[b])
