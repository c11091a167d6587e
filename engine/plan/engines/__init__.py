"""Engine models: builtin (exact), and the pinned SGLang and vLLM profiles (engines/profiles.py)."""

from headroom.engine.plan.engines.base import EngineModel, Layout
from headroom.engine.plan.engines.profiles import PROFILES, Profile, UnknownProfile, resolve_profile


def engine_model(name: str, version: str | None = None, flavour: str | None = None) -> EngineModel:
    """The engine model of a profile; ValueError (UnknownProfile) lists the profiles when there is none."""
    return resolve_profile(name, version, flavour).model()


__all__ = ["PROFILES", "EngineModel", "Layout", "Profile", "UnknownProfile", "engine_model", "resolve_profile"]
