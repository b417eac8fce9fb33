"""One model-agnostic `apply_<technique>` per parallelism technique (ddp, fsdp, tp, pp, ac),
composed by `compose.parallelize`; `dims` turns degrees into a DeviceMesh."""
