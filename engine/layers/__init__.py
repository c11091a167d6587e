"""Model building blocks over flattened batches; compute goes through headroom.kernels.ops."""
