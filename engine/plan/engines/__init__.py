"""Engine models: builtin (exact), sglang and vllm (their own memory formulas and flags)."""

from headroom.engine.plan.engines.base import EngineModel, Layout
from headroom.engine.plan.engines.builtin import BuiltinEngine
from headroom.engine.plan.engines.sglang import SGLangEngine
from headroom.engine.plan.engines.vllm import VLLMEngine


def engine_model(name: str) -> EngineModel:
    models: dict[str, type[EngineModel]] = {"builtin": BuiltinEngine, "sglang": SGLangEngine, "vllm": VLLMEngine}
    if name not in models:
        raise ValueError(f"engine {name!r} is not one of {', '.join(models)}")
    return models[name]()


__all__ = ["EngineModel", "Layout", "engine_model"]
