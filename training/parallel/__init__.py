"""One model-agnostic `apply_<technique>` function per parallelism technique."""
