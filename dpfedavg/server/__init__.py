"""The server side of Alg. 1 / Alg. 2 without Flower: its state and round math (`dp_server`), the one
round loop (`loop`), the run's bookkeeping (`session`) and its assembly (`run`).

The Flower strategy (`dpfedavg.flower.strategy`) and the batched engine (`dpfedavg.engines.batched`)
both drive `DPServer`. No Flower import; nothing is imported here.
"""
