"""pytorchexample: a Flower / PyTorch app on generated CIFAR-shaped data."""
