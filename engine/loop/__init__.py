"""The engine thread: one step (schedule -> cache -> runtime -> sample), the cache-backed capacity, the inbox."""
