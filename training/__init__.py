"""What stages train with: models, data, parallelism, the loop, metrics and probes.

Knows nothing of the pipeline, MLflow or launchers: every function here takes explicit arguments
and works inside whatever torch.distributed world it is called in (or none).
"""
