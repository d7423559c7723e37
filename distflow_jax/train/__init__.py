"""Training: optimizers from config and the jitted actor / critic steps."""
