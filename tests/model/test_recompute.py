"""kvrag.model.recompute: the stitched layout's positions and mask, and plain prefill continued from a shared prefix.
(That stitching equals full prefill is proven in test_exactness.py.)"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny import FACTS, byte_tokenizer, tiny_model

from kvrag.model.kvmodel import KVModel
from kvrag.model.recompute import causal_mask, full_prefill, stitch_layout


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_stitched_positions_are_a_permutation_and_the_mask_is_causal(data):
    lengths = data.draw(st.lists(st.integers(1, 12), min_size=1, max_size=6))
    n = len(lengths)
    order = data.draw(st.permutations(range(n)))
    recompute = {}
    for c in range(n):
        picked = data.draw(st.lists(st.integers(0, lengths[c] - 1), unique=True, max_size=lengths[c]))
        if picked:
            recompute[c] = torch.tensor(sorted(picked))
    P, suffix = data.draw(st.integers(1, 5)), data.draw(st.integers(1, 4))
    layout = stitch_layout(P, lengths, [P] * n, order, recompute, suffix)
    N = P + sum(lengths) + suffix
    assert sorted(layout.key_positions.tolist()) == list(range(N))  # every position once: cache then new input
    assert layout.query_positions.tolist() == layout.key_positions[-len(layout.query_positions) :].tolist()
    mask = causal_mask(layout.key_positions, layout.query_positions, torch.float32)[0, 0]
    allowed = mask == 0
    for i, qp in enumerate(layout.query_positions.tolist()):
        assert allowed[i].tolist() == [kp <= qp for kp in layout.key_positions.tolist()]
    assert layout.selected.numel() == sum(len(s) for s in recompute.values())


def test_a_prefill_continued_from_a_shared_prefix_equals_its_full_prefill() -> None:
    kv = KVModel(tiny_model("qwen2"), byte_tokenizer())
    ids = [kv.layout.chunk_ids(text) for text, _ in FACTS[:3]]
    given, moved = kv.prompt_ids("Who?", ids, [0, 1, 2]), kv.prompt_ids("Who?", ids, [0, 2, 1])
    shared = len(kv.prefix) + len(ids[0])
    source = full_prefill(kv.model, given).cache
    continued = full_prefill(kv.model, moved, cache=source, shared=shared)
    whole = full_prefill(kv.model, moved)
    torch.testing.assert_close(continued.logits, whole.logits, rtol=1e-4, atol=1e-4)
    for a, b in zip(continued.cache.layers, whole.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a.values, b.values, rtol=1e-4, atol=1e-4)
    assert source.get_seq_length() == len(given)  # the source cache is copied from, never changed
