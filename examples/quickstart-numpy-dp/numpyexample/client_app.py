"""numpyexample: a Flower ClientApp in numpy, wrapped in dpfedavg's dp_mod."""

from dpfedavg import dp_mod
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from numpyexample.task import load_data, train

app = ClientApp(mods=[dp_mod])


@app.train()
def train_fn(msg: Message, context: Context):
    """A few gradient steps on local data; the new weights go back (dp_mod turns them into a private update)."""
    arrays = msg.content["arrays"]
    x, y = load_data(context.node_config["partition-id"])
    w, b, loss = train(
        arrays["w"].numpy(), arrays["b"].numpy(), x, y, msg.content["config"]["lr"], context.run_config["local-epochs"]
    )
    model = ArrayRecord({"w": Array(w), "b": Array(b)})
    metrics = MetricRecord({"train_loss": loss, "num-examples": len(y)})
    return Message(RecordDict({"arrays": model, "metrics": metrics}), reply_to=msg)
