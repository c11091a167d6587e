"""bench/engine_speed_parts.py's _transformers_torch_delta_rule (LOGIT_HF_TORCH=1): inside, transformers' Qwen3.5
module calls its own torch delta-rule functions, not the fla wrappers; after, the wrappers are back (the bf16 bound
runs as transformers picks); a name that is no wrapped function (the hub's kernel modules) is an error before
anything is patched. A fake module stands in for transformers', whose wrapping depends on what is installed."""

import functools
import importlib.util
import sys
import types
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "engine_speed_parts", Path(__file__).resolve().parents[2] / "bench" / "engine_speed_parts.py")
engine_speed_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(engine_speed_parts)

NAME = "transformers.models.qwen3_5.modeling_qwen3_5"
FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def _fake_module(wrap=True) -> types.ModuleType:
    module = types.ModuleType(NAME)
    for name in FUNCTIONS:
        def torch_function(*args, _name=name):
            return ("torch", _name)
        torch_function.__module__ = NAME
        torch_function.__name__ = name

        @functools.wraps(torch_function)
        def wrapper(*args, _name=name):
            return ("fla", _name)
        setattr(module, name, wrapper if wrap else torch_function)
    return module


def test_the_torch_functions_inside_the_wrappers_after(monkeypatch):
    module = _fake_module()
    monkeypatch.setitem(sys.modules, NAME, module)
    wrappers = {name: getattr(module, name) for name in FUNCTIONS}
    assert [getattr(module, name)() for name in FUNCTIONS] == [("fla", name) for name in FUNCTIONS]
    with engine_speed_parts._transformers_torch_delta_rule():
        assert [getattr(module, name)() for name in FUNCTIONS] == [("torch", name) for name in FUNCTIONS]
    assert {name: getattr(module, name) for name in FUNCTIONS} == wrappers
    # restored after an error inside too
    with pytest.raises(KeyError), engine_speed_parts._transformers_torch_delta_rule():
        raise KeyError("inside")
    assert {name: getattr(module, name) for name in FUNCTIONS} == wrappers


def test_unwrapped_torch_functions_are_kept(monkeypatch):
    module = _fake_module(wrap=False)
    monkeypatch.setitem(sys.modules, NAME, module)
    with engine_speed_parts._transformers_torch_delta_rule():
        assert [getattr(module, name)() for name in FUNCTIONS] == [("torch", name) for name in FUNCTIONS]


def test_anything_else_is_an_error_and_patches_nothing(monkeypatch):
    module = _fake_module()
    wrapper = module.torch_chunk_gated_delta_rule

    class Func:  # what transformers makes of a function with the hub's kernels installed
        def __call__(self, *args):
            return ("hub", None)

    module.torch_recurrent_gated_delta_rule = Func()
    monkeypatch.setitem(sys.modules, NAME, module)
    with pytest.raises(RuntimeError, match="torch_recurrent_gated_delta_rule is a Func"):
        with engine_speed_parts._transformers_torch_delta_rule():
            pass
    assert module.torch_chunk_gated_delta_rule is wrapper
