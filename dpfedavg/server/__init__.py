"""The server side of Alg. 1 / Alg. 2 without Flower: its state and round math (:mod:`.dp_server`), the one
round loop (:mod:`.loop`), the run's bookkeeping (:mod:`.session`) and its assembly (:mod:`.run`).

The Flower strategy (:mod:`dpfedavg.flower.strategy`) and the batched engine (:mod:`dpfedavg.engines.batched`)
both drive :class:`~dpfedavg.server.dp_server.DPServer`. No Flower import; nothing is imported here.
"""
