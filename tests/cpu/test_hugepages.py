"""Tensors on huge pages: what they hold, where they start, what the kernel was asked for; and the decoder keeps
its weights there, each layer's in one buffer that the model's own modules view."""

import gc
import re

import pytest
import torch
from tiny import tiny_model

from kvrag.cpu import hugepages
from kvrag.cpu.decode import FastDecoder

needs_huge = pytest.mark.skipif(not hugepages.available(), reason="no transparent huge pages on this system")


def _flags(tensor):
    """The VmFlags of the mapping that holds the tensor's first byte (Linux)."""
    address = tensor.data_ptr()
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
            if span:
                inside = int(span[1], 16) <= address < int(span[2], 16)
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    raise AssertionError("no mapping holds the tensor")


def test_a_small_tensor_is_torchs_own():
    small = hugepages.empty((100, 3), torch.float32)
    assert small.shape == (100, 3) and small.dtype == torch.float32 and small.is_contiguous()


@needs_huge
@pytest.mark.parametrize("huge, flag", [(True, "hg"), (False, "nh")])
def test_a_large_tensor_starts_on_a_huge_page_and_asks_for_them(huge, flag):
    tensor = hugepages.empty((3, hugepages.HUGE // 2 + 5), torch.bfloat16, huge=huge)
    assert tensor.shape == (3, hugepages.HUGE // 2 + 5) and tensor.dtype == torch.bfloat16 and tensor.is_contiguous()
    assert tensor.data_ptr() % hugepages.HUGE == 0
    assert flag in _flags(tensor)  # madvise(MADV_HUGEPAGE) or (MADV_NOHUGEPAGE) took


def test_a_large_tensor_keeps_its_memory_while_a_view_lives():
    tensor = hugepages.empty((hugepages.HUGE,), torch.float32)
    tensor.copy_(torch.arange(hugepages.HUGE, dtype=torch.float32))
    tail = tensor[-10:]
    del tensor
    gc.collect()
    hugepages.empty((hugepages.HUGE,), torch.float32).fill_(-1)  # memory freed above would be reused here
    assert torch.equal(tail, torch.arange(hugepages.HUGE - 10, hugepages.HUGE, dtype=torch.float32))


def test_the_decoder_keeps_each_layers_weights_in_one_buffer_the_modules_view():
    model = tiny_model("llama", seed=3)
    ids = torch.tensor([[5, 9, 200, 17, 3, 44]])
    before = model(ids).logits.clone()
    decoder = FastDecoder(model)
    assert torch.equal(model(ids).logits, before)
    for layer, fast in zip(model.model.layers, decoder.layers):
        attn, mlp = layer.self_attn, layer.mlp
        linears = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        starts = [m.weight.data_ptr() for m in linears]
        assert len({m.weight.untyped_storage().data_ptr() for m in linears}) == 1  # one buffer
        assert starts == sorted(starts)  # in the order a step reads them
        assert fast.qkv.weight.data_ptr() == starts[0] and fast.down.weight.data_ptr() == starts[-1]
    assert model.lm_head.weight.data_ptr() == decoder.lm_head.weight.data_ptr()


@needs_huge
def test_a_layer_of_a_few_megabytes_is_on_huge_pages():
    model = tiny_model("llama", seed=3)
    mlp = model.model.layers[0].mlp
    wide = torch.nn.Linear(mlp.gate_proj.in_features, 16384, bias=False)
    mlp.gate_proj.weight = wide.weight  # [16384, D]: the layer's buffer outgrows a huge page
    decoder = FastDecoder(model)
    first = decoder.layers[0].qkv.weight
    assert first.data_ptr() % hugepages.HUGE == 0 and "hg" in _flags(first)
