"""numpyexample: linear regression in numpy: the model, each client's data, local training."""

import numpy as np

NUM_FEATURES = 8
TRUE_WEIGHTS = np.random.default_rng(0).normal(size=NUM_FEATURES)


def initial_model() -> dict[str, np.ndarray]:
    """The model: weights and a bias, all zeros."""
    return {"w": np.zeros(NUM_FEATURES, dtype=np.float32), "b": np.zeros(1, dtype=np.float32)}


def load_data(partition_id: int, num_examples: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """This client's data: y = x . w* + 0.5 + noise."""
    rng = np.random.default_rng(100 + partition_id)
    x = rng.normal(size=(num_examples, NUM_FEATURES))
    return x, x @ TRUE_WEIGHTS + 0.5 + 0.1 * rng.normal(size=num_examples)


def mse(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((x @ w + b - y) ** 2))


def train(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray, lr: float, epochs: int):
    """Full-batch gradient descent on the mean squared error; the new weights and the final loss."""
    w, b = w.astype(np.float64), b.astype(np.float64)
    for _ in range(epochs):
        residual = x @ w + b - y
        w = w - lr * 2 * x.T @ residual / len(y)
        b = b - lr * 2 * residual.mean(keepdims=True)
    return w.astype(np.float32), b.astype(np.float32), mse(w, b, x, y)
