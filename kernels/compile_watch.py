"""Which Triton kernels compile, and when: a hook on the Triton JIT's cache misses.

Why: a kernel specialisation first met while serving compiles inside somebody's request (1.8 s for a 30-token
prompt on the H200, bench/results/session4). The warm-up is meant to compile every specialisation serving
uses before /ready; this hook is how the server proves it did, or names the one it missed (log and /metrics).
An autotuner timing its configs compiles each of them, so those count too.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any


class CompileWatch:
    """Counts every Triton compile in this process once installed; `on_compile(repr)` is called for each."""

    def __init__(self, keep: int = 32):
        self.count = 0
        self.recent: deque[str] = deque(maxlen=keep)
        self.on_compile: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        self._installed = False

    def install(self) -> bool:
        """Chain onto Triton's JIT cache hook (keeping any hook already set). False where Triton is absent."""
        if self._installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        previous = knobs.runtime.jit_cache_hook

        def hook(**kwargs: Any) -> bool:
            self._record(str(kwargs.get("repr", kwargs.get("key", "?"))))
            # A true return tells Triton to skip the compile: only the hook we displaced may ask for that.
            return bool(previous(**kwargs)) if previous is not None else False

        knobs.runtime.jit_cache_hook = hook
        self._installed = True
        return True

    def _record(self, what: str) -> None:
        with self._lock:
            self.count += 1
            self.recent.append(what)
        if self.on_compile is not None:
            self.on_compile(what)
