"""Engine profiles: one per engine release (or fork) whose sizing rules the planner transcribes.

A profile is (kind, version, flavour). `sglang` and `vllm` without a version mean the newest stock
release here; a fork's capability (integer KV in SGLang) is a flavour the user names, never a default.
A new release is a new profile, held to that release's parsers and sizing code (tests/peers/).
"""

from __future__ import annotations

from dataclasses import dataclass

from headroom.engine.plan.engines.base import EngineModel
from headroom.engine.plan.engines.builtin import BuiltinEngine
from headroom.engine.plan.engines.sglang import SGLangEngine
from headroom.engine.plan.engines.sglang_int_kv import SGLangIntKVEngine
from headroom.engine.plan.engines.vllm import VLLMEngine


@dataclass(frozen=True)
class Profile:
    kind: str
    version: str | None
    flavour: str | None
    model: type[EngineModel]
    source: str

    @property
    def label(self) -> str:
        return " ".join(p for p in (self.kind, self.version, self.flavour) if p)


PROFILES: tuple[Profile, ...] = (
    Profile("builtin", None, None, BuiltinEngine, "headroom's own engine"),
    Profile("sglang", SGLangEngine.version, None, SGLangEngine, "sglang on PyPI"),
    Profile("sglang", SGLangIntKVEngine.version, "int-kv", SGLangIntKVEngine,
            "the field report's fork (SGLang 0.5.19 with an INT2/INT4 KV patch)"),
    Profile("vllm", VLLMEngine.version, None, VLLMEngine, "vllm on PyPI"),
)


class UnknownProfile(ValueError):
    """No profile for this engine, version and flavour; the message lists those there are."""


def profile_labels() -> str:
    return ", ".join(p.label for p in PROFILES)


def resolve_profile(kind: str, version: str | None = None, flavour: str | None = None) -> Profile:
    """The profile for an engine kind, release and flavour; version None: the kind's (flavour's) profile."""
    if kind == "builtin":
        if flavour:
            raise UnknownProfile(f"engine builtin has no flavour {flavour!r}; profiles: {profile_labels()}")
        return PROFILES[0]
    matches = [p for p in PROFILES if p.kind == kind and p.flavour == flavour]
    if version is not None:
        wanted = version.removeprefix("v")
        matches = [p for p in matches if p.version == wanted]
    if not matches:
        what = " ".join(x for x in (kind, version, flavour) if x)
        raise UnknownProfile(f"no engine profile for {what}; profiles: {profile_labels()}")
    return matches[0]
