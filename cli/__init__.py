"""headroom: plan, serve and operate hybrid-attention LLMs on one GPU node."""

__version__ = "0.1.0"
