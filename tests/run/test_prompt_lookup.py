"""Prompt-lookup speculation in greedy decoding: drafts from the prompt and the answer, verified by the C step's
several-token pass, give exactly the tokens (and the cache) of decoding one token a step."""

import copy

import pytest
import torch
from tiny import FAST_DECODED, tiny_model

from kvrag.answer import last_answer
from kvrag.cpu import ckernel
from kvrag.cpu.decode import decoder_of, native_decoding
from kvrag.errors import InvalidRequestError
from kvrag.run.generate import PromptLookup, Sampling, decode
from kvrag.model.recompute import full_prefill

TAKEN = FAST_DECODED
needs_kernels = pytest.mark.skipif(not ckernel.available(), reason="no C compiler for kvrag.cpu.ckernel")


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    lookup = PromptLookup([5, 6, 7, 8, 1, 6, 7, 9, 2, 6], room=8)
    assert lookup.draft(2) == [7, 9]  # [6] last seen before the end at 5: 7, 9 followed it
    lookup.push(7)
    assert lookup.draft(3) == [9, 2, 6]  # [6, 7] last at 5..6 (3-gram [2, 6, 7] never seen)
    lookup.push(8)  # [6, 7, 8]: at 1..3 only, followed by 1, 6, 7
    assert lookup.draft(3) == [1, 6, 7]
    assert lookup.draft(0) == []
    lookup.push(3)  # never seen: no draft
    assert lookup.draft(4) == []
    tail = PromptLookup([4, 4], room=2)
    assert tail.draft(5) == [4]  # what followed the earlier 4: only the ids there are


def test_drafts_are_fed_while_their_chance_of_confirmation_beats_their_cost():
    lookup = PromptLookup([1, 2, 3], room=60)

    def expected(available):  # the j-th draft while rate ** j > COST
        return max(j for j in range(available + 1) if j == 0 or lookup.rate**j > PromptLookup.COST)

    assert lookup.worth(7) == expected(7)
    for _ in range(12):
        lookup.push(5, guessed=5)  # the lookup keeps guessing right
    assert lookup.rate > 0.98 and lookup.worth(7) == 7 and lookup.worth(3) == 3
    rate = lookup.rate
    lookup.push(6, guessed=None)  # nothing guessed: the rate stays
    assert lookup.rate == rate
    lookup.push(6, guessed=5)
    assert 0 < lookup.worth(7) == expected(7) < 7
    for _ in range(4):
        lookup.push(6, guessed=7)
    assert lookup.worth(7) == 0  # wrong too often: no drafts, until its guesses come right again
    for _ in range(4):
        lookup.push(6, guessed=6)
    assert lookup.worth(7) == expected(7) > 0


def test_sampling_checks_the_draft_count():
    assert Sampling().prompt_lookup > 0  # on by default: the tokens are the same
    assert Sampling(prompt_lookup=0).prompt_lookup == 0
    for bad in (-1, ckernel.MAX_TOKENS, 2.5, True):
        with pytest.raises(InvalidRequestError, match="prompt_lookup"):
            Sampling(prompt_lookup=bad)


def _decode(model, prompt, tokens, drafts, eos=()):
    out = full_prefill(model, prompt)
    sampling = Sampling(max_new_tokens=tokens, prompt_lookup=drafts)
    answer = list(decode(model, out.cache, out.logits[-1], out.next_position, sampling, eos, context=prompt))
    return answer, out.cache


class _Counted:
    """Counts the C step's calls and the tokens they fed."""

    def __init__(self, native):
        self.native, self.calls, self.fed = native, 0, 0

    def __getattr__(self, name):
        return getattr(self.native, name)

    def steps(self, tokens, *args):
        self.calls += 1
        self.fed += len(tokens)
        return self.native.steps(tokens, *args)

    def __call__(self, token, *args):
        self.calls += 1
        self.fed += 1
        return self.native(token, *args)


def _cycling(name, dtype, motif):
    """A tiny model whose greedy answer walks `motif` round and round: each token's logits peak at the motif's
    next token (its head's row for that token is the previous token's embedding), attention and MLP still
    computed but scaled down so that they do not move the peak. Prompt lookup's drafts are then confirmed."""
    model = copy.deepcopy(tiny_model(name)).to(dtype)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(1e-2)
            layer.mlp.down_proj.weight.mul_(1e-2)
        embed = model.model.embed_tokens.weight
        head = embed.clone()
        for i, token in enumerate(motif):
            head[motif[(i + 1) % len(motif)]] = embed[token]
        model.lm_head.weight.copy_(head * 4)
    return model


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", TAKEN)
def test_speculation_gives_the_tokens_and_cache_of_one_token_a_step(name, dtype, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    motif = torch.randperm(247, generator=gen)[:12].add(3).tolist()
    prompt = torch.randint(3, 250, (40,), generator=gen).tolist() + motif * 3
    for model, confirmed in ((copy.deepcopy(tiny_model(name)).to(dtype), False), (_cycling(name, dtype, motif), True)):
        assert native_decoding(model, True)
        decoder = decoder_of(model)
        counted = _Counted(decoder.native)
        monkeypatch.setattr(decoder, "native", counted)
        plain, plain_cache = _decode(model, prompt, 48, drafts=0)
        assert counted.calls == 47 and counted.fed == 47  # one token a step
        if confirmed:
            assert plain[:13] == [*motif, motif[0]]  # the model walks the motif
        for drafts in (1, 3, ckernel.MAX_TOKENS - 1):
            counted.calls = counted.fed = 0
            fast, fast_cache = _decode(model, prompt, 48, drafts=drafts)
            assert fast == plain, f"{drafts} draft tokens"
            assert counted.fed >= 47  # every token fed, and the drafts
            if confirmed:  # every draft confirmed: one draft a pass about halves the passes, more cut them further
                assert counted.calls <= (26 if drafts == 1 else 16), f"{counted.calls} passes"
            for a, b in zip(plain_cache.layers, fast_cache.layers):
                assert a.keys.shape == b.keys.shape == (1, a.keys.shape[1], len(prompt) + 47, a.keys.shape[-1])
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


@needs_kernels
def test_an_answer_ends_where_it_would_inside_a_confirmed_draft():
    """EOS and the token limit stop the answer at the same token when it falls among a step's drafts."""
    gen = torch.Generator().manual_seed(6)
    motif = torch.randperm(247, generator=gen)[:10].add(3).tolist()
    model = _cycling("llama", torch.float32, motif)
    prompt = torch.randint(3, 250, (30,), generator=gen).tolist() + motif * 2
    plain, _ = _decode(model, prompt, 40, drafts=0)
    assert plain[:10] == motif
    for limit in (1, 2, 5, 17):
        assert _decode(model, prompt, limit, drafts=4)[0] == plain[:limit]
    for stop in motif[1:4]:  # the answer's 2nd to 4th tokens, all inside the first pass's confirmed drafts
        assert _decode(model, prompt, 40, drafts=4, eos=(stop,))[0] == plain[: plain.index(stop) + 1]


@needs_kernels
def test_sampled_decoding_and_other_steps_take_no_drafts(monkeypatch):
    model = copy.deepcopy(tiny_model("qwen2"))
    decoder = decoder_of(model)
    counted = _Counted(decoder.native)
    monkeypatch.setattr(decoder, "native", counted)
    prompt = [7, 8, 9] * 20
    out = full_prefill(model, prompt)
    sampling = Sampling(max_new_tokens=12, temperature=0.7, seed=3, prompt_lookup=4)
    list(decode(model, out.cache, out.logits[-1], out.next_position, sampling, (), context=prompt))
    assert counted.fed == counted.calls == 11
    native_decoding(model, False)  # the torch step: one token a pass, the same tokens
    plain, _ = _decode(model, prompt, 20, drafts=0)
    assert _decode(model, prompt, 20, drafts=4)[0] == plain


@needs_kernels
def test_the_engine_drafts_from_the_stitched_prompt(kv, monkeypatch):
    """An answer through the engine looks its drafts up in its whole prompt (prefix, chunks, question), and its
    text is the one decoding without drafts gives; a whole-prompt generation looks up in its prompt."""
    from kvrag.run import generate

    seen = []

    class Recorded(generate.PromptLookup):
        def __init__(self, context, room):
            seen.append(list(context))
            super().__init__(context, room)

    monkeypatch.setattr(generate, "PromptLookup", Recorded)
    chunks = ["the cat sat on the mat. " * 3, "a dog ran in the fog. " * 3]
    question = "where did the cat sit?"
    texts = {d: kv.answer(question, chunks, max_new_tokens=24, prompt_lookup=d).text for d in (0, 3)}
    assert texts[0] == texts[3]
    layout = kv.layout
    a, b = layout.chunk_ids(chunks[0]), layout.chunk_ids(chunks[1])
    # one lookup (none with prompt_lookup=0), over the prompt as stitched: the target chunk next to the question
    prefix, suffix = layout.prefix_ids, layout.suffix_ids(question)
    assert seen in ([[*prefix, *a, *b, *suffix]], [[*prefix, *b, *a, *suffix]])
    prompt = "the cat sat on the mat. the cat"
    whole = {d: last_answer(kv.stream_prompt(prompt, max_new_tokens=16, prompt_lookup=d)).text for d in (0, 2)}
    assert whole[0] == whole[2] and seen[-1] == list(kv.tokenizer(prompt, add_special_tokens=False)["input_ids"])
