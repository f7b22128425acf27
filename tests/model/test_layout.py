"""Prompt layout: prefix + chunks + suffix ids are exactly the ids of the full prompt."""

import pytest
from tiny import byte_tokenizer

from kvrag.errors import EmptyInputError, LayoutError
from kvrag.model.layout import PromptLayout


def test_stitched_ids_equal_the_rendered_prompt_ids():
    tok = byte_tokenizer()
    layout = PromptLayout(tok, system_prompt="Be brief.")
    chunks = ["First document.", "  Second one, with spaces around.  "]
    stitched = layout.prefix_ids + [t for c in chunks for t in layout.chunk_ids(c)] + layout.suffix_ids("Why?")
    content = layout.header + "".join(c.strip() + "\n\n" for c in chunks) + "Question: Why?\nAnswer:"
    rendered = tok.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert stitched == tok(rendered, add_special_tokens=False)["input_ids"]
    assert tok.decode(layout.prefix_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert tok.decode(layout.suffix_ids("Why?")).endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_chunks_carry_no_bos_and_prefix_is_question_independent():
    tok = byte_tokenizer()
    layout = PromptLayout(tok)
    assert tok.bos_token_id not in layout.chunk_ids("text")
    before = list(layout.prefix_ids)
    layout.suffix_ids("another question")
    assert layout.prefix_ids == before


def test_plain_layout_for_base_models_starts_with_bos():
    from tokenizers.processors import TemplateProcessing

    tok = byte_tokenizer(chat_template=None)
    tok._tokenizer.post_processor = TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 256)])
    layout = PromptLayout(tok)
    assert not layout.use_chat_template
    assert layout.prefix_ids[0] == tok.bos_token_id
    assert tok.bos_token_id not in layout.chunk_ids("a chunk") + layout.suffix_ids("Who?")
    assert tok.decode(layout.suffix_ids("Who?")) == "Question: Who?\nAnswer:"


def test_bad_input_is_refused_clearly():
    layout = PromptLayout(byte_tokenizer())
    with pytest.raises(EmptyInputError, match="chunk is empty"):
        layout.chunk_ids("  \n ")
    with pytest.raises(EmptyInputError, match="question is empty"):
        layout.suffix_ids("")
    with pytest.raises(LayoutError, match="{question}"):
        PromptLayout(byte_tokenizer(), question_template="no placeholder")


def test_template_that_rewrites_content_is_refused():
    tok = byte_tokenizer(chat_template="{% for m in messages %}{{ m['content'] | upper }}{% endfor %}")
    with pytest.raises(LayoutError, match="verbatim"):
        PromptLayout(tok)


def test_a_chunk_is_tokenized_once_and_each_caller_gets_its_own_list():
    tok = byte_tokenizer()
    layout = PromptLayout(tok)
    calls = []
    tokenize = layout._ids
    layout._ids = lambda text: calls.append(text) or tokenize(text)  # type: ignore[method-assign]
    first = layout.chunk_ids("A chunk seen by every query.")
    first.append(-1)
    again = layout.chunk_ids("A chunk seen by every query.")
    assert again == first[:-1] == tok("A chunk seen by every query.\n\n", add_special_tokens=False)["input_ids"]
    assert len(calls) == 1
    with pytest.raises(EmptyInputError):
        layout.chunk_ids("   ")


def test_a_layout_with_remembered_ids_pickles_and_copies():
    import copy
    import pickle

    layout = PromptLayout(byte_tokenizer())
    ids = layout.chunk_ids("Kept between queries.")
    for other in (pickle.loads(pickle.dumps(layout)), copy.deepcopy(layout)):
        assert other.chunk_ids("Kept between queries.") == ids and other.chunk_ids("New.") == layout.chunk_ids("New.")
