"""The log line of a kernel compiled after /ready: counted in /metrics, and named with its arguments' types and
specialisations, where two variants of one kernel differ (a 400-character cut hid them in session 13)."""

from __future__ import annotations

import logging
from types import SimpleNamespace

from headroom.engine.server import factory
from headroom.engine.server.metrics import EngineMetrics


def test_a_compile_after_ready_is_counted_and_logged_with_its_whole_signature(caplog):
    metrics = EngineMetrics()
    report = factory._compile_reporter(SimpleNamespace(metrics=metrics), before_ready=51)
    arguments = ", ".join(f"arg{i}: ('i32', 'D')" for i in range(120))
    kernel = f"paged_attention_fwd_kernel[num_warps=8, num_stages=3]({arguments}, stride_table: ('i32', '')"
    assert len(kernel) > 2000
    with caplog.at_level(logging.WARNING, logger=factory.logger.name):
        report(kernel)
    assert metrics.kernel_compiles._value.get() == 1
    line = caplog.records[-1].getMessage()
    assert "compile 1 after /ready, 51 before" in line and line.endswith("stride_table: ('i32', '')")
