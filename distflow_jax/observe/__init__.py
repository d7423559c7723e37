"""Observation of a run: the progress line, metrics files and plots, the run report,
TensorBoard and Weights & Biases logging, sample logs, the health monitor, next-step hints
and the run's config record.  It may import state/ and the layers below it; never persist/,
warmstart/, run/ or the commands.
"""
