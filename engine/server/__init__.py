"""The HTTP edge: FastAPI app, OpenAI protocol, generate path, factory, `headroom serve` CLI, metrics, tokenizer."""
