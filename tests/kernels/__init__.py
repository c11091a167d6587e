import os

# Triton kernels in these tests run on CPU tensors through the interpreter; triton.jit reads this when a
# kernel module is imported, so it must be set before any test module here imports one.
os.environ.setdefault("TRITON_INTERPRET", "1")
