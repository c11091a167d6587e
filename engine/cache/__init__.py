"""Pure cache bookkeeping: KV and SSM slot allocators, the radix tree with SSM checkpoints, CacheManager. No torch."""
