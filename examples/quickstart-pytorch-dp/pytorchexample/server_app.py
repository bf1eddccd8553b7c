"""pytorchexample: a Flower / PyTorch app."""

import torch
from dpfedavg import DPFedAvg
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from pytorchexample.task import Net, load_centralized_dataset, test

# Create ServerApp
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Main entry point for the ServerApp."""
    fraction_train: float = context.run_config["fraction-train"]
    num_rounds: int = context.run_config["num-server-rounds"]
    lr: float = context.run_config["lr"]

    # Load the global model
    global_model = Net()
    arrays = ArrayRecord(global_model.state_dict())

    # Initialize the strategy
    strategy = DPFedAvg(fraction_train=fraction_train, clip=0.3, epsilon=8.0, delta=1e-5)

    # Start the strategy
    result = strategy.start(
        grid=grid,
        initial_arrays=arrays,
        train_config=ConfigRecord({"lr": lr}),
        num_rounds=num_rounds,
        evaluate_fn=global_evaluate,
    )

    # Save the final model to disk
    torch.save(result.arrays.to_torch_state_dict(), context.run_config["model-path"])


def global_evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    """Evaluate the global model on the server's test set."""
    model = Net()
    model.load_state_dict(arrays.to_torch_state_dict())
    loss, accuracy = test(model, load_centralized_dataset(), torch.device("cpu"))
    return MetricRecord({"accuracy": accuracy, "loss": loss})
