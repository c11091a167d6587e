"""The pass policy: request types, the capacity protocol, prefill admission and the scheduler. No torch."""
