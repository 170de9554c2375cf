"""Memory planning: predict a training step's peak without allocating it, measure the real one,
choose micro-batch x accumulation under a budget, and recover from OOM at run time."""
