"""Start-up: the simulation's size checked before Ray has started, and one retry of a slow start-up (issue 48).

Cheap: in-process Grids and a fake start-up that fails once; nothing here starts Flower or Ray.
"""

from __future__ import annotations

import pytest
from flwr.common.constant import HEARTBEAT_INTERVAL_INF
from flwr.proto.node_pb2 import NodeInfo

from dpfedavg.config import RunConfig
from dpfedavg.flower.app_strategy import DPFedAvg
from dpfedavg.flower.client_app import app as client_app
from dpfedavg.flower.federation import FederationError
from dpfedavg.flower.testing import InProcessGrid

DIM = 4


def _cfg(**overrides) -> RunConfig:
    base = {"num-clients": 20, "clients-per-round": 5.0, "num-rounds": 2, "dim": DIM, "epsilon": 0.0,
            "noise-multiplier": 0.0, "node-wait-timeout": 300.0}  # fmt: skip
    return RunConfig.from_run_config({**base, **overrides})


class SimulatedGrid(InProcessGrid):
    """Nodes as Flower's simulation registers them: all at once, heartbeats off (``HEARTBEAT_INTERVAL_INF``)."""

    def get_nodes(self):
        return [NodeInfo(node_id=nid, heartbeat_interval=HEARTBEAT_INTERVAL_INF) for nid in self.get_node_ids()]


@pytest.mark.parametrize(("supernodes", "per_node", "needed"), [(2, 1, 20), (3, 5, 4), (30, 1, 20)])
def test_a_simulation_of_the_wrong_size_fails_before_any_node_is_asked(supernodes, per_node, needed) -> None:
    """One line naming num-supernodes, num-clients, clients-per-node and the fix; no message sent (so no ClientApp
    or Ray was needed), no waiting out node-wait-timeout (the sleeps are counted, not timed)."""
    cfg = _cfg(**{"clients-per-node": per_node})
    grid = SimulatedGrid(client_app, supernodes, cfg.to_run_config())
    slept: list[float] = []
    with pytest.raises(FederationError) as err:
        DPFedAvg(cfg, dim=DIM, sleep=slept.append).discover_clients(grid)
    line = str(err.value)
    assert "\n" not in line
    assert f"num-supernodes={supernodes}" in line and "num-clients=20" in line and f"clients-per-node={per_node}" in line
    assert f'--federation-config "num-supernodes={needed}"' in line
    assert grid.sent == [] and sum(slept) < 1.0


def test_a_simulation_of_the_right_size_is_discovered_as_before() -> None:
    cfg = _cfg(**{"clients-per-node": 5})
    grid = SimulatedGrid(client_app, 4, cfg.to_run_config())
    mapping = DPFedAvg(cfg, dim=DIM, sleep=lambda s: None).discover_clients(grid)
    assert sorted(mapping) == list(range(4))  # partition ids of the 4 SuperNodes


def test_a_deployment_below_the_size_still_waits_for_late_supernodes() -> None:
    """Deployed SuperNodes (finite heartbeats) may connect later: they keep node-wait-timeout."""
    cfg = _cfg()

    class Late(InProcessGrid):
        polls = 0

        def get_nodes(self):
            return [NodeInfo(node_id=nid, heartbeat_interval=30.0) for nid in self.get_node_ids()]

        def get_node_ids(self):
            Late.polls += 1
            return list(self.contexts)[: min(20, 5 * Late.polls)]

    mapping = DPFedAvg(cfg, dim=DIM, sleep=lambda s: None).discover_clients(Late(client_app, 20, cfg.to_run_config()))
    assert sorted(mapping) == list(range(20)) and Late.polls >= 4
