"""What the engine (pipelines/), the stages and the training library all use and none owns: the
user-facing configuration error and the atomic file write. A leaf: it imports nothing of the project."""
