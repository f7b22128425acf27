"""Decoding: sampling parameters, stop strings and incremental detokenization."""

import pytest
import torch
from tiny import byte_tokenizer

from kvrag.errors import InvalidRequestError
from kvrag.run.generate import Detokenizer, Sampling, pick_token


def feed(detok, text):
    ids = detok.tokenizer(text, add_special_tokens=False)["input_ids"]
    pieces = []
    for i in ids:
        pieces.append(detok.push(i))
        if detok.stopped:
            break
    return pieces


def test_pieces_join_to_the_text_and_multibyte_characters_are_never_split():
    detok = Detokenizer(byte_tokenizer())
    pieces = feed(detok, "naïve café ☕")
    pieces.append(detok.finish())
    assert "".join(pieces) == detok.text == "naïve café ☕"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_ends_text_before_it_and_nothing_of_it_leaks():
    detok = Detokenizer(byte_tokenizer(), stop=["\nQuestion:"])
    pieces = feed(detok, "Paris.\nQuestion: next")
    assert detok.stopped
    assert "".join(pieces) + detok.finish() == detok.text == "Paris."


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    detok = Detokenizer(byte_tokenizer(), stop=["###"])
    pieces = feed(detok, "a ## b")
    assert not detok.stopped
    assert "".join(pieces) + detok.finish() == "a ## b"


def test_greedy_and_seeded_sampling():
    logits = torch.tensor([0.1, 3.0, 0.2, 2.9])
    assert pick_token(logits, Sampling(), None) == 1
    sampling = Sampling(temperature=1.0, seed=3)
    a = [pick_token(logits, sampling, torch.Generator().manual_seed(3)) for _ in range(5)]
    b = [pick_token(logits, sampling, torch.Generator().manual_seed(3)) for _ in range(5)]
    assert a == b
    draws = {pick_token(logits, Sampling(temperature=1.0), torch.Generator().manual_seed(s)) for s in range(50)}
    assert draws >= {1, 3}


def test_top_p_keeps_only_the_nucleus():
    logits = torch.log(torch.tensor([0.6, 0.3, 0.05, 0.05]))
    g = torch.Generator().manual_seed(0)
    draws = {pick_token(logits, Sampling(temperature=1.0, top_p=0.5), g) for _ in range(100)}
    assert draws == {0}
    draws = {pick_token(logits, Sampling(temperature=1.0, top_p=0.85), g) for _ in range(200)}
    assert draws == {0, 1}


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_new_tokens": "3"}, "max_new_tokens must be an int"),
        ({"max_new_tokens": None}, "max_new_tokens must be an int"),
        ({"max_new_tokens": 2.0}, "max_new_tokens must be an int"),
        ({"max_new_tokens": True}, "max_new_tokens must be an int"),
        ({"temperature": ""}, "temperature must be a number"),
        ({"seed": "a"}, "seed must be an int"),
        ({"stop": 5}, "stop must be a string or a list of strings"),
        ({"stop": ["ok", 3]}, "stop must be a string or a list of strings"),
    ],
)
def test_bad_sampling_values_are_refused(kwargs, match):
    with pytest.raises(InvalidRequestError, match=match):
        Sampling(**kwargs)


def _prefills(model, prompts):
    from kvrag.model.recompute import full_prefill

    outs = [full_prefill(model, ids) for ids in prompts]
    return outs, [(o.cache, o.logits[-1], o.next_position) for o in outs]


@pytest.mark.parametrize("sampling", [Sampling(max_new_tokens=9), Sampling(max_new_tokens=7, temperature=0.9, seed=3)])
def test_answers_decoded_together_are_each_answer_decoded_alone(sampling):
    """Three prompts of different lengths, one ended early by its stop check: every answer's tokens are `decode`'s
    for it alone, and each cache is left as that decode leaves it."""
    import copy

    from tiny import tiny_model

    from kvrag.cpu import ckernel
    from kvrag.run.generate import decode, decode_together

    if not ckernel.available():
        pytest.skip("no C compiler for kvrag.cpu.ckernel")
    model = copy.deepcopy(tiny_model("qwen2"))
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (12, 40, 7)]
    outs, prefills = _prefills(model, prompts)
    alone = []
    for out in _prefills(model, prompts)[0]:
        alone.append(list(decode(model, out.cache, out.logits[-1], out.next_position, sampling, eos_ids=())))
    ends_at = alone[1][3]  # answer 1 stops at its fourth token

    together = decode_together(model, prefills, sampling, eos_ids=(), stopped=lambda i, t: i == 1 and t == ends_at)
    assert together is not None
    for i, (mine, own) in enumerate(zip(together, alone)):
        if i == 1:
            cut = own.index(ends_at) + 1
            assert mine.tokens == own[:cut] and mine.finish == "stop"
        else:
            assert mine.tokens == own and mine.finish == "length"
    assert [o.cache.get_seq_length() for o in outs] == [len(p) + len(t.tokens) - 1 for p, t in zip(prompts, together)]


def test_answers_are_not_decoded_together_where_the_c_step_does_not_take_the_model(monkeypatch):
    import copy

    from tiny import tiny_model

    from kvrag.cpu import ckernel
    from kvrag.run.generate import decode_together

    monkeypatch.setattr(ckernel, "_library", lambda: None)
    model = copy.deepcopy(tiny_model("llama"))
    _, prefills = _prefills(model, [[5, 6, 7], [8, 9]])
    assert decode_together(model, prefills, Sampling(max_new_tokens=4), eos_ids=()) is None
