"""Run outputs on disk: ``metrics.csv``, ``config.json``, ``model.npz`` and the checkpoint."""
