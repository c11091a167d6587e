"""kernels/compile_watch.py: every compile Triton's JIT reports through its cache hook is counted and handed on,
and a hook that was there before keeps working (including its power to skip a compile)."""

from __future__ import annotations

from headroom.kernels.compile_watch import CompileWatch
from triton import knobs


def _miss(name: str):
    """What Triton's JIT does on a cache miss: call the hook with these keywords, compile unless it says True."""
    hook = knobs.runtime.jit_cache_hook
    return hook(key=(name,), repr=f"{name}[num_warps=4](n: i32)", fn=None, compile={}, is_manual_warmup=False,
                already_compiled=False)


def test_compiles_are_counted_and_reported(monkeypatch):
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", None)
    watch, seen = CompileWatch(), []
    assert watch.install()
    assert _miss("warm") is False
    watch.on_compile = seen.append
    assert _miss("late") is False
    assert watch.count == 2 and list(watch.recent) == ["warm[num_warps=4](n: i32)", "late[num_warps=4](n: i32)"]
    assert seen == ["late[num_warps=4](n: i32)"]


def test_a_hook_already_installed_still_runs_and_decides(monkeypatch):
    calls = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: calls.append(kw["key"]) or True)
    watch = CompileWatch()
    watch.install()
    assert _miss("k") is True  # the earlier hook asked Triton to skip this compile; that answer stands
    assert calls == [("k",)] and watch.count == 1
