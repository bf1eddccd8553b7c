"""Engines that run a configured experiment end to end.

* `dpfedavg.engines.batched`: the same math vectorized over the sampled
  clients in one process (fast, for sweeps);
* `dpfedavg.engines.flower`: the real Flower app through ``flwr run`` on
  a private local SuperLink (`dpfedavg.engines.local_superlink`).

Both write the same files (``metrics.csv``, ``config.json``, ``model.npz``)
and, for one seed, the same trajectory.
"""

ENGINES: tuple[str, ...] = ("batched", "flower")
