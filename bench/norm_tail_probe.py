"""Probe of the norm tail on a GPU (kernels/gemv.py residual_normed_gemv; engine/layers/residual.py NORM_TAIL): at
the 4B model's 2,560-wide residual GEMVs of several rows, with this GPU's table configs, its bits against
residual_gemv then norm_triton's rms_norm (50 launches back to back, each against the first), and the time of a
CUDA graph of 24 (residual GEMV, norm, next GEMV) steps each way (decode_parts.graph_replay_us): residual_gemv then
rms_norm's launch then the next GEMV, against residual_normed_gemv (at each NORM_TAIL_PROBE_ELEMENTS) then the next
GEMV (four weight copies a shape, so L2 cannot hold them). Writes after every shape.
`python3 bench/norm_tail_probe.py OUT.json`"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from decode_parts import graph_replay_us

# The tail's tile sizes timed (kernels/gemv.py TAIL_ELEMENTS), NORM_TAIL_PROBE_ELEMENTS: a comma list of powers of 2.
TAIL_ELEMENTS = [int(e) for e in os.environ.get("NORM_TAIL_PROBE_ELEMENTS", "4096").split(",") if e.strip()]
# (residual GEMV, norm, next GEMV) steps a graph
STEPS = 24


def _probe(n: int, k: int, m: int, config, nxt) -> dict:
    from headroom.kernels import gemv as g
    from headroom.kernels.norm_triton import rms_norm

    dev = torch.device("cuda")
    weights = [(torch.randn(n, k, device=dev) * 0.02).bfloat16() for _ in range(4)]
    follow = [(torch.randn(10240, n, device=dev) * 0.02).bfloat16() for _ in range(4)]
    x = torch.randn(m, k, device=dev).bfloat16()
    residual = (torch.randn(m, n, device=dev) * 4).bfloat16()
    tail = g.NormTail((0.1 * torch.randn(n, device=dev)).bfloat16(), 1e-6, True)
    summed, normed = g.residual_normed_gemv(x, weights[0], residual, tail, config)
    want_sum, _ = g.residual_gemv(x, weights[0], residual, config)
    want = rms_norm(want_sum, tail.weight, 1e-6, True)[0]
    again = [g.residual_normed_gemv(x, weights[0], residual, tail, config) for _ in range(50)]
    row = {"n": n, "k": k, "m": m, "sum_equal": torch.equal(summed, want_sum),
           "normed_max_abs": float((normed.float() - want.float()).abs().max()),
           "normed_frac_differing": float((normed != want).float().mean()),
           "repeats_differing": sum(not (torch.equal(a, summed) and torch.equal(b, normed)) for a, b in again)}

    def unfused(i: int) -> torch.Tensor:
        s, _ = g.residual_gemv(x, weights[i % 4], residual, config)
        return g.gemv(rms_norm(s, tail.weight, 1e-6, True)[0], follow[i % 4], nxt)

    def tailed(i: int) -> torch.Tensor:
        _, h = g.residual_normed_gemv(x, weights[i % 4], residual, tail, config)
        return g.gemv(h, follow[i % 4], nxt)

    def steps_us(step) -> float:
        return graph_replay_us(lambda: [step(i) for i in range(STEPS)], STEPS, 20)

    shipped = g.TAIL_ELEMENTS
    try:
        row["unfused_us_a_step"] = steps_us(unfused)
        for elements in TAIL_ELEMENTS:
            g.TAIL_ELEMENTS = elements
            row[f"tail_{elements}_us_a_step"] = steps_us(tailed)
        row["unfused_again_us_a_step"] = steps_us(unfused)
    finally:
        g.TAIL_ELEMENTS = shipped
    return row


def main() -> None:
    from headroom.kernels import gemv as g

    target = Path(sys.argv[1])
    table = g.load_tuned_configs(torch.device("cuda"))
    out: dict = {"gpu": torch.cuda.get_device_name(), "rows": []}
    for (n, k, m, kind), config in sorted(table.items()):
        nxt = table.get((10240, 2560, m, g.PLAIN_INPUT))  # attention's qkv shape as the next projection
        if n != 2560 or m == 1 or kind != g.PLAIN_INPUT or nxt is None:
            continue
        out["rows"].append(_probe(n, k, m, config, nxt))
        target.write_text(json.dumps(out, indent=1))
        print(out["rows"][-1], flush=True)
    target.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
