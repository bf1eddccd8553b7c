"""The paper's experiments: §4.4 (Figures 1-3) and §5 (Table 1)."""
