"""Built-in verifiable tasks (dataset generators) for the default run."""
