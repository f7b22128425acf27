"""The tenant timing probe (`kvrag.lab.bench.tenants`): under keys, a tenant who knows another's label gets no
hit on that tenant's texts; unkeyed, every one is a hit. Times are printed by the probe, not tested."""

from tiny import HashEmbedder, byte_tokenizer, tiny_model

from kvrag import KVModel
from kvrag.lab.bench.tenants import probe


def test_keys_give_another_tenant_no_hit_where_unkeyed_it_gets_every_one():
    kv = KVModel(tiny_model("llama"), byte_tokenizer())
    corpus = [f"Entry {i}: the function returns {i * 7} when called." for i in range(6)]
    keyed = probe(kv, HashEmbedder(), texts=3, rounds=2, corpus=corpus)
    assert keyed["hits_on_stored"] == 0 and keyed["hits_on_unseen"] == 0
    unkeyed = probe(kv, HashEmbedder(), texts=3, rounds=2, keyed=False, corpus=corpus)
    assert unkeyed["hits_on_stored"] == 3 * 2 and unkeyed["hits_on_unseen"] == 0
    assert keyed["ttft_stored_s"] > 0 and unkeyed["ratio"] > 0
