"""Engine-agnostic measurement client over the OpenAI HTTP API: `headroom smoke` and `headroom bench`."""
