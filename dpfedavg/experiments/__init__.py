"""The paper's experiments: §4.4 (Figures 1-3) and §5 (Table 1), private tuning, and the scale benchmark."""

#: The paper's two algorithms, the grids' default: DP-FedAvg with clipping (Alg. 1) and DP-NormFedAvg (Alg. 2).
PAPER_ALGORITHMS: tuple[str, ...] = ("clip", "norm")
