"""The model side of one pass: KV and SSM pool tensors, ModelRunner, ForwardBatch, decode graphs, loader, sampling."""
