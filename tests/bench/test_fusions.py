"""bench/engine_speed_parts.py's FUSIONS: every switch fusion_speed flips names a real switch of the engine's layers,
and the value it restores as shipped is one of the two it times (a renamed or removed switch would otherwise time
two identical engines, or fail only on the GPU)."""

import importlib
import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "engine_speed_parts", Path(__file__).resolve().parents[2] / "bench" / "engine_speed_parts.py")
engine_speed_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_speed_parts)


@pytest.mark.parametrize("fusion", sorted(engine_speed_parts.FUSIONS))
def test_every_fusion_switch_is_an_engine_switch(fusion):
    for name, attribute, *values in engine_speed_parts.FUSIONS[fusion]:
        module = engine_speed_parts.fusion_module(name)
        assert hasattr(module, attribute), (fusion, name, attribute)
        on, off = values or (True, False)
        shipped = getattr(module, attribute)
        assert type(shipped) is type(on) is type(off) and on != off, (fusion, attribute, shipped, on, off)
        assert shipped in (on, off), (fusion, attribute, shipped)
