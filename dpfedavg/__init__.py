"""dpfedavg: DP-FedAvg (clipping) and DP-NormFedAvg (normalization) on Flower.

Das, Hashemi, Sanghavi, Dhillon, "On the Convergence of Differentially Private
Federated Learning on Non-Lipschitz Objectives, and with Normalized Client
Updates". The math lives in :mod:`dpfedavg.core`; the Flower glue in
:mod:`dpfedavg.flower.client_app`, :mod:`dpfedavg.flower.server_app` and
:mod:`dpfedavg.flower.strategy`.
"""

__version__ = "0.1.0"
