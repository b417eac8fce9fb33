"""The engine: config schema, stage DAG, cache, launchers and tracking."""
