"""numpyexample: a Flower ServerApp; dpfedavg's settings come from the [tool.flwr.app.config.dpfedavg] table."""

import numpy as np
from dpfedavg import DPFedAvg
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from numpyexample.task import initial_model, load_data, mse

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Train privately for num-server-rounds rounds, then save the model."""
    strategy = DPFedAvg.from_run_config(context.run_config)  # the keys of [tool.flwr.app.config.dpfedavg]
    result = strategy.start(
        grid=grid,
        initial_arrays=ArrayRecord({k: Array(v) for k, v in initial_model().items()}),
        num_rounds=context.run_config["num-server-rounds"],
        train_config=ConfigRecord({"lr": context.run_config["lr"]}),
        evaluate_fn=evaluate,
    )
    np.savez(context.run_config["model-path"], **{k: v.numpy() for k, v in result.arrays.items()})


def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Mean squared error on held-out data."""
    x, y = load_data(partition_id=-1, num_examples=500)
    return MetricRecord({"mse": mse(arrays["w"].numpy(), arrays["b"].numpy(), x, y)})
