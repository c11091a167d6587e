"""Triton kernels with pure-torch naive_* references beside them."""
