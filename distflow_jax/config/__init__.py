"""Config loading (ml_collections files + command-line overrides) and checks."""
