"""headroom's inference engine. The planner (engine.plan) is pure and importable without torch."""
