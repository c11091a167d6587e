"""bench/decode_parts.py's pure parts: the GEMV table a step tuning writes (the tuning itself runs on the GPU)."""

import importlib.util
import re
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "decode_parts", Path(__file__).resolve().parents[2] / "bench" / "decode_parts.py")
decode_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(decode_parts)

TILE = {"block_n": 16, "block_k": 512, "split": 1, "num_warps": 4, "num_stages": 2, "swap_ab": False,
        "rows_on_cores": False, "prefetch": 1, "stream": 0, "l2_prefetch": 0}


def _entry(layer, n, k, m, **fields):
    return {"layer": layer, "n": n, "k": k, "m": m, **TILE, "us": 10.0, "cublas_us": 12.0, **fields}


def _tried(shipped, chosen, alone=7.5, unfused=9.0):
    """step_gemv_tune's rows: the shipped configuration (None: no entry), none, and the one chosen."""
    rows = [{"config": shipped, "step_us": 100.0, "alone_us": 8.0}] if shipped is not None else []
    rows.append({"config": None, "step_us": 99.0, "alone_us": unfused})
    return rows + [{"config": chosen, "step_us": 90.0, "alone_us": alone}] if chosen is not None else rows


def test_step_table_changes_adds_and_drops_only_what_the_tuning_moved():
    four_rows = {**TILE, "block_n": 4}
    previous = [_entry("gdn_out_proj", 2560, 4096, 1), _entry("attn_o_proj", 2560, 4096, 1),
                _entry("mlp_gate_up", 18432, 2560, 1), _entry("attn_qkv", 10240, 2560, 1),
                _entry("mlp_gate_up", 18432, 2560, 16)]
    tune = {"rows": {"1": {"entries": {
        # both layers of the shared shape move together
        "2560x4096 x": {"changed": True, "chosen": four_rows, "tried": _tried(TILE, four_rows)},
        "18432x2560 x": {"changed": False, "chosen": TILE, "tried": _tried(TILE, None)},
        "10240x2560 x": {"changed": True, "chosen": None, "tried": _tried(TILE, None)},  # back to cuBLAS
        "2560x9216 silu_mul": {"changed": True, "chosen": four_rows, "tried": _tried(None, four_rows)},
    }}, "8": {"entries": {
        "2560x9216 x": {"changed": True, "chosen": TILE, "tried": _tried(None, TILE, alone=20.004, unfused=21.6)},
    }}}}
    table = decode_parts.step_table(tune, previous)
    by_key = {(e["n"], e["k"], e["m"], e.get("input", "x"), e["layer"]): e for e in table}
    assert len(table) == 6  # five, one dropped, two added
    for layer in ("gdn_out_proj", "attn_o_proj"):
        assert by_key[(2560, 4096, 1, "x", layer)] == {**_entry(layer, 2560, 4096, 1), **four_rows, "us": 7.5,
                                                     "step_tuned": True}
    assert by_key[(18432, 2560, 1, "x", "mlp_gate_up")] == previous[2]
    assert by_key[(18432, 2560, 16, "x", "mlp_gate_up")] == previous[4]  # a row count not tuned
    assert not any(e["n"] == 10240 for e in table)
    assert by_key[(2560, 9216, 1, "silu_mul", "mlp_down_silu_mul")] == {
        "layer": "mlp_down_silu_mul", "n": 2560, "k": 9216, "m": 1, "input": "silu_mul", **four_rows, "us": 7.5,
        "step_tuned": True, "unfused_us": 9.0}
    assert by_key[(2560, 9216, 8, "x", "mlp_down")] == {
        "layer": "mlp_down", "n": 2560, "k": 9216, "m": 8, **TILE, "us": 20.0, "step_tuned": True, "cublas_us": 21.6}
    assert previous[0]["block_n"] == 16  # the previous entries are not changed in place


def test_step_table_gives_the_h100_table_shipped_from_session_23s_call_5():
    """Real data: call 5's tuning at 8 and 16 rows (its output named each plain entry by shape alone, before the
    fused SwiGLU entries had a kind of their own), over the table that call ran, against the H100 table shipped
    from it (written by hand then)."""
    import json

    folder = Path(__file__).resolve().parents[2] / "bench" / "results" / "session23" / "call5_step_tune_bs8_16"
    tune = json.loads((folder / "engine_speed_detail.json").read_text())["detail"]["gemv_step"]["tune"]
    tune = {"rows": {m: {"entries": {f"{shape} x": result for shape, result in rows["shapes"].items()}}
                     for m, rows in tune["rows"].items()}}
    ran, shipped = (json.loads((folder / name).read_text())["configs"]
                    for name in ("gemv_table_ran.json", "gemv_table_shipped_after.json"))

    def keyed(entries):
        return sorted(entries, key=lambda e: (e["n"], e["k"], e["m"], e.get("input", "x"), e["layer"]))

    assert keyed(decode_parts.step_table(tune, ran)) == keyed(shipped)


def test_table_variant_changes_the_entries_its_keys_name_and_no_other():
    """"*" and "NxK" change one-row entries (as part_llm_gemv always did), "*@M" and "NxK@M" those of M rows; a
    shape's own fields win over the general key's; every other entry is the shipped configuration itself."""
    from headroom.kernels.gemv import GemvConfig

    plain = GemvConfig(block_n=16, block_k=512)
    shipped = {(2560, 4096, 1, "x"): plain, (2560, 9216, 1, "silu_mul"): plain,
               (2560, 4096, 8, "x"): GemvConfig(block_n=64, block_k=256, split=3, swap_ab=True),
               (18432, 2560, 8, "x"): GemvConfig(block_n=32, block_k=256), (2560, 4096, 16, "x"): plain}
    variant = decode_parts.table_variant(shipped, {"*": {"l2_prefetch": 2}, "2560x9216": {"l2_prefetch": 4},
                                                   "*@8": {"prefetch": 2}, "2560x4096@8": {"split": 6}})
    assert variant[(2560, 4096, 1, "x")].l2_prefetch == 2
    assert variant[(2560, 9216, 1, "silu_mul")].l2_prefetch == 4
    assert variant[(2560, 4096, 8, "x")] == GemvConfig(block_n=64, block_k=256, split=6, swap_ab=True, prefetch=2)
    assert variant[(18432, 2560, 8, "x")] == GemvConfig(block_n=32, block_k=256, prefetch=2)
    assert variant[(2560, 4096, 16, "x")] is plain
    assert decode_parts.table_variant(shipped, {}) == shipped
    # a key that names no entry would time the shipped table under the variant's name: refused, naming it
    for stray in ("2560x4069@8", "*@4", "1x1"):
        with pytest.raises(ValueError, match=re.escape(f"['{stray}'] name no entry")):
            decode_parts.table_variant(shipped, {"*@8": {"prefetch": 2}, stray: {"prefetch": 2}})


def test_step_candidates_keep_the_entrys_l2_prefetch_at_several_rows_only():
    from headroom.kernels.gemv import GemvConfig

    swept = [GemvConfig(64, 256, 3, swap_ab=True), GemvConfig(64, 128, swap_ab=True, stream=1),
             GemvConfig(8, 512, rows_on_cores=True)]
    entry = GemvConfig(64, 256, 3, swap_ab=True, l2_prefetch=2)
    kept = decode_parts.step_candidates(swept, entry, 8)
    assert [c.l2_prefetch for c in kept] == [2, 0, 2]  # stream-K asks L2 for nothing
    assert [c.block_n for c in kept] == [64, 64, 8] and kept[0].split == 3
    # one row, no entry, or an entry without it: the sweep's configurations as they are
    assert decode_parts.step_candidates(swept, entry, 1) == swept
    assert decode_parts.step_candidates(swept, None, 16) == swept
    assert decode_parts.step_candidates(swept, GemvConfig(64, 256, 3, swap_ab=True), 16) == swept
