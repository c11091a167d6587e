"""Test and bench helper: the Triton kernel variants the attention layer (engine/layers/paged_attention.py) launches
for given batches, at the 4B model's heads over one layer's pool of any KV format, through Triton's real JIT for
sm_90 in a child process (tests/kernels/sm90_child.py; nothing compiled or launched: each launch's specialisation
key is recorded and skipped). What a server compiles after /ready is a variant that a request's passes launch and
the warm-up's did not: groups of batches compared against a base group say which."""

from __future__ import annotations

import importlib.util
from pathlib import Path

_CHILD = r'''
from headroom.engine.layers import paged_attention as layer
from headroom.engine.runtime.forward_batch import BatchItem, ForwardBatch
from headroom.engine.runtime.kv_pool import KVPool
from headroom.engine.sequence import Sequence
from headroom.kernels import ops
from headroom.kernels import paged_attention as pa

# The layer's kernels as a GPU runs them (the CPU's ops take the naive path), every launch recorded and skipped.
ops.paged_attention = lambda q, p, o, t, s, n, kv, sc, max_q_len=None, prev=None, out=None, out_lse=None, \
    window=None, gate=None: pa.paged_attention(q, p, o, t, s, n, kv, sc, max_q_len, out=out, out_lse=out_lse,
                                               prev=prev, window=window, gate=gate)
ops.dequantize_block = pa.dequantize_block
keys = {}
current = [None]


def skip(**kw):
    keys.setdefault(current[0], set()).add((kw["fn"].name, str(kw["key"])))
    return True


triton.knobs.runtime.jit_cache_hook = skip
HQ, HKV, D, PAGE = 16, 4, 256, 32
longest = max(sum(-(-n // PAGE) * PAGE for n in lengths) for batches in GROUPS.values() for lengths in batches)
pool = KVPool(longest + PAGE, 1, HKV, D, KV_DTYPE, torch.bfloat16, torch.device("cpu"), residual_rows=64)
for group, batches in GROUPS.items():
    current[0] = group
    for lengths in batches:
        seqs, first = [], 0
        for i, n in enumerate(lengths):
            seq = Sequence(f"p{i}", list(range(n)))
            pages = -(-n // PAGE)
            seq.kv_slots = list(range(first, first + pages * PAGE))
            first += pages * PAGE
            pool.store(0, seq, 0, torch.zeros(n, HKV, D, dtype=torch.bfloat16),
                       torch.zeros(n, HKV, D, dtype=torch.bfloat16))
            seqs.append(seq)
        # A batch of one-token lengths after a long prompt is a decode step: each sequence's last token alone.
        decode = DECODE.get(group, False)
        for seq in seqs:
            seq.num_computed_tokens = len(seq.token_ids) - 1 if decode else 0
        items = [BatchItem(seq, [0] if decode else list(range(n))) for seq, n in zip(seqs, lengths)]
        batch = ForwardBatch.build(items, torch.device("cpu"))
        rows = len(items) if decode else sum(lengths)
        layer.paged_attention_over_pool(torch.zeros(rows, HQ, D, dtype=torch.bfloat16), batch, pool, 0, D**-0.5)
        for seq in seqs:
            pool.release(seq)
base = set().union(*(keys.get(group, set()) for group in BASE))
print(json.dumps({group: sorted(f"{name} {key}" for name, key in found - base)
                  for group, found in keys.items() if group not in BASE}))
'''


def variants_outside(base: list[str], groups: dict[str, list[list[int]]], kv_dtype: str, tmp_path: Path,
                     decode: dict[str, bool] | None = None) -> dict[str, list[str]]:
    """For each group not in `base` (its batches: lists of prompt lengths, each prompt a whole chunk; decode[group]:
    the batches are decode steps after prompts of those lengths), the kernel variants its passes launch that the
    base groups' do not, as 'kernel key' strings."""
    spec = importlib.util.spec_from_file_location("sm90_child", Path(__file__).parents[2] / "kernels" / "sm90_child.py")
    assert spec is not None and spec.loader is not None
    child = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(child)
    return child.run_on_sm90(_CHILD, tmp_path, GROUPS=groups, BASE=base, KV_DTYPE=kv_dtype, DECODE=decode or {})
