"""Pure numpy math of DP-FedAvg / DP-NormFedAvg, shared by every engine.

No Flower import here: the Flower apps, the batched engine and the tests all
call these functions.
"""

from dpfedavg.core.dp import (
    ALGORITHMS,
    BOUNDS,
    SensitivityBound,
    bound_sensitivity,
    clip,
    gaussian_noise,
    get_bound,
    normalize,
    server_noise_std,
)
from dpfedavg.core.local import (
    ClientUpdate,
    LocalTrainingDiverged,
    client_round_update,
    client_update,
    local_steps,
    private_block_update,
    private_client_update,
    round_block_update,
)
from dpfedavg.core.noise import NOISE_LAWS, NoiseLaw, noise_law, round_noise_law
from dpfedavg.core.secagg import SecAggGrid
from dpfedavg.core.seeding import (
    SECURE_NOISE_SEED,
    RoundStreams,
    Stream,
    make_rng,
    noise_rng,
    round_noise_seed,
    secure_rng,
)
from dpfedavg.core.server import (
    fixed_denominator_mean,
    keep_random_iterate,
    local_lr_at,
    momentum_step,
    poisson_sample,
    server_lr_at,
)
from dpfedavg.core.types import GradFn, Vector

__all__ = [
    "ALGORITHMS",
    "BOUNDS",
    "SensitivityBound",
    "get_bound",
    "SECURE_NOISE_SEED",
    "ClientUpdate",
    "LocalTrainingDiverged",
    "GradFn",
    "NOISE_LAWS",
    "NoiseLaw",
    "SecAggGrid",
    "noise_law",
    "round_noise_law",
    "RoundStreams",
    "Stream",
    "Vector",
    "fixed_denominator_mean",
    "bound_sensitivity",
    "client_update",
    "clip",
    "client_round_update",
    "gaussian_noise",
    "keep_random_iterate",
    "local_lr_at",
    "local_steps",
    "make_rng",
    "momentum_step",
    "noise_rng",
    "normalize",
    "poisson_sample",
    "private_block_update",
    "round_block_update",
    "private_client_update",
    "round_noise_seed",
    "secure_rng",
    "server_lr_at",
    "server_noise_std",
]
