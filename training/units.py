"""Byte units, defined once (binary: what device memory and `torch.cuda` report)."""

KIB = 1024
MIB = 1024**2
GIB = 1024**3
