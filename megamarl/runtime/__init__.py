"""Run services around the loop: metrics (JSONL + wandb, with the ``logger:`` config section),
plots of a run directory, and the run checkpoint (atomic step directories, resume, RNG states)."""
