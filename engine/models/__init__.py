"""Model definitions (pure torch): Qwen3 full attention and Qwen3.5 / Qwen3-Next hybrids."""
