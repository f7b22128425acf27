"""A question a part at a time: the splitter, the caller's parts, hops, and each part equal to itself asked alone."""

import pytest
from tiny import FACTS, STRATEGY_CHUNKS, byte_tokenizer, tiny_model

from kvrag import InvalidRequestError, KVModel
from kvrag.plan.parts import Part, compose, decide, number_in, parts_of, resolve_parts, short_answer, split


@pytest.mark.parametrize(
    "question, parts",
    [
        (
            "What is the founding year of Velloria, and who is the founder of Dorwick?",
            ["What is the founding year of Velloria?", "Who is the founder of Dorwick?"],
        ),
        (
            "What is the birth year of each of Liora Pellwyn, Petra Vorith and Lucan Vorley?",
            ["What is the birth year of Liora Pellwyn?", "What is the birth year of Petra Vorith?",
             "What is the birth year of Lucan Vorley?"],
        ),
        (
            "what are the main products of both Kasith Works and Dorwick Mills",
            ["What are the main products of Kasith Works?", "What are the main products of Dorwick Mills?"],
        ),
        ("Which was founded earlier, Wynton or Quenmouth?",
         ["When was Wynton founded?", "When was Quenmouth founded?"]),
        ("Which town has the larger population, Velloria or Dorwick?",
         ["What is the population of Velloria?", "What is the population of Dorwick?"]),
        ("Which company has more employees, Kasith Works or Dorwick Mills?",
         ["How many employees does Kasith Works have?", "How many employees does Dorwick Mills have?"]),
        ("Which river is longer, the Arn or the Bes?", ["How long is the Arn?", "How long is the Bes?"]),
        ("Which of Velloria and Dorwick is older?", ["How old is Velloria?", "How old is Dorwick?"]),
        ("What is the best-known book of the founder of Kasith Works?",
         ["Who is the founder of Kasith Works?", "What is the best-known book of {answer}?"]),  # a hop
        ("What is the birthplace of the first captain of the Velia?",
         ["Who is the first captain of the Velia?", "What is the birthplace of {answer}?"]),
        ("What is the default value of the timeout parameter of connect?", None),  # no person between: whole
        ("Which is better, tea or coffee?", None),  # no measure to ask each for
        ("How do I read and write files?", None),  # "and" inside one question
        ("What is the mayor of each of Velloria?", None),  # one thing: nothing to split
    ],
)
def test_the_splitter_takes_the_common_forms_and_leaves_the_rest_whole(question, parts):
    got = split(question)
    assert (None if got is None else [p.question for p in got]) == parts


def test_a_comparison_is_decided_in_code_from_the_numbers_its_parts_answer():
    earlier = split("Which was founded earlier, Wynton or Quenmouth?")
    assert [(p.entity, p.wins) for p in earlier] == [("Wynton", "min"), ("Quenmouth", "min")]
    assert compose(earlier, ["Wynton was founded in 1,801.", "In 1732."]) == "Quenmouth (1732 against 1801)."
    larger = split("Which river is longer, the Arn or the Bes?")
    assert decide(larger, ["It is 412.5 km long.", "The Bes is 87 km long."]) == "The Arn (412.5 against 87)."
    older = split("Which of Velloria and Dorwick is older?")  # answered with founding years: the smaller wins
    assert decide(older, ["Founded in 1801.", "Founded in 1732."]) == "Dorwick (1732 against 1801)."
    assert decide(older, ["It is 200 years old.", "30 years."]) == "Velloria (200 against 30)."
    # nothing to decide: a tie, an answer without a number or with two, parts that are no comparison
    for answers in (["1801", "1801"], ["long ago", "1732"], ["from 1801 to 1850", "1732"]):
        assert decide(earlier, answers) is None
    assert compose(earlier, ["long ago", "1732"]) == "long ago\n1732"
    assert decide([Part("a?"), Part("b?")], ["1", "2"]) is None
    assert number_in("about 12,400 people") == 12400 and number_in("2.0 and 3") is None and number_in("none") is None


def test_a_hop_takes_the_previous_answer_without_its_echo():
    hop = split("What is the birth year of the founder of Velloria?")
    assert short_answer(hop[0].question, "The founder of Velloria is Ilsa Morn.") == "Ilsa Morn"
    assert short_answer(hop[0].question, "She was Ilsa Morn.\nMore text") == "Ilsa Morn"
    assert hop[1].asked_after(hop[0], "Ilsa Morn.") == "What is the birth year of Ilsa Morn?"
    assert hop[1].asked_after(hop[0], "The founder of Velloria is Ilsa Morn.") == "What is the birth year of Ilsa Morn?"


def test_callers_parts_hops_and_their_errors():
    parts = parts_of(["Who founded Velloria?", "What is the birth year of {answer}?"])
    assert [p.hop for p in parts] == [False, True]
    assert parts[1].asked("Marten Velek.") == "What is the birth year of Marten Velek?"
    assert resolve_parts("Who is it?", None) is None and resolve_parts("Who is it?", "auto") is None
    for bad, message in (
        ([], "non-empty list"),
        ("all", 'give "auto", "model" or a list'),
        (["What is {answer}?"], "no part comes before it"),
        (["Who?", ""], "part 1 is ''"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            resolve_parts("q", bad)
    assert compose([Part("a?"), Part("b?")], [" 1873. ", "Elsa\nMorrow"]) == "1873.\nElsa Morrow"


@pytest.fixture(scope="module")
def kv():
    return KVModel(tiny_model("llama"), byte_tokenizer())


@pytest.mark.parametrize("side_by_side", [True, False])
def test_each_part_is_answered_as_if_asked_alone_over_chunk_kv_read_once(kv, monkeypatch, side_by_side):
    """Decoded side by side (one pass of the C step a token for both parts) or, where the C step is off, one
    part after the other: the same tokens as each part asked alone."""
    from kvrag.cpu import ckernel, cstep
    from kvrag.cpu.decode import native_decoding

    if side_by_side and not ckernel.available():
        pytest.skip("no C compiler for kvrag.cpu.ckernel")
    passes = []
    rows = cstep.DecodeStep.rows
    monkeypatch.setattr(cstep.DecodeStep, "rows", lambda self, tokens, *a: passes.append(len(tokens)) or rows(
        self, tokens, *a))
    native_decoding(kv.model, side_by_side)
    questions = ["When does the archive open?", "What do cats hunt?"]
    whole = "When does the archive open, and what do cats hunt?"
    try:
        got = kv.answer(whole, STRATEGY_CHUNKS, parts="auto", strategy="target_recompute", max_new_tokens=6)
    finally:
        native_decoding(kv.model, True)
    assert (passes[0] == 2 and len(passes) == 5) if side_by_side else not passes
    assert [p.question for p in split(whole)] == questions and len(got.parts) == 2
    for part, question in zip(got.parts, questions):
        alone = kv.answer(question, STRATEGY_CHUNKS, strategy="target_recompute", picker="likelihood", max_new_tokens=6)
        assert part.token_ids == alone.token_ids and part.stats.target == alone.stats.target
        assert part.stats.picker == "likelihood"  # no scores: each part picks by its own likelihood
    assert got.text == "\n".join(" ".join(p.text.split()) for p in got.parts)
    assert got.token_ids == got.parts[0].token_ids + got.parts[1].token_ids
    assert got.stats.new_tokens == sum(p.stats.new_tokens for p in got.parts)
    # the chunks were encoded once for both parts (the count is the shared chunks', not one a part)
    assert got.parts[0].stats.chunks_encoded == got.parts[1].stats.chunks_encoded <= len(STRATEGY_CHUNKS)
    assert got.stats.total_s >= got.parts[0].stats.total_s and got.stats.ttft_s <= got.stats.total_s
    assert "parts" in got.to_dict() and len(got.to_dict()["parts"]) == 2
    # a question the splitter cannot split is answered whole, as without parts
    plain = kv.answer("When does the archive open?", STRATEGY_CHUNKS, parts="auto", max_new_tokens=4)
    assert plain.parts == [] and plain.token_ids == kv.answer("When does the archive open?", STRATEGY_CHUNKS,
                                                              max_new_tokens=4).token_ids


def test_the_engine_scores_each_part_against_the_retrieved_chunks(kv):
    from tiny import HashEmbedder

    from kvrag import KVRAG
    from kvrag.cache.store import MemoryStore
    from kvrag.engine.documents import Document

    rag = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore())
    rag.ingest([Document(text, meta) for text, meta in FACTS], split=False, progress=False)
    question = "Who built the lighthouse of Karsa, and who runs Velloria's harbour?"
    got = rag.query(question, parts="auto", top_k=4, strategy="target_recompute", max_new_tokens=4)
    picked = [p.sources[p.stats.target].text for p in got.parts]
    assert "lighthouse of Karsa" in picked[0] and "harbour" in picked[1]  # each part its own target
    assert [s.text for s in got.sources] == [s.text for s in got.parts[0].sources]  # retrieved once
    assert got.stats.retrieve_s > 0 and got.composed == "lines"


def test_a_hop_retrieves_again_with_the_previous_answer(kv, monkeypatch):
    from tiny import HashEmbedder

    from kvrag import KVRAG
    from kvrag.cache.store import MemoryStore
    from kvrag.engine.documents import Document

    rag = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore())
    rag.ingest([Document(text, meta) for text, meta in FACTS], split=False, progress=False)
    asked = []
    retrieve = rag.retrieve
    monkeypatch.setattr(rag, "retrieve", lambda q, **kw: asked.append(q) or retrieve(q, **kw))
    got = rag.query("Who runs Velloria's harbour?", parts=["Who runs Velloria's harbour?", "Where does {answer} live?"],
                    top_k=2, max_new_tokens=4)
    first = got.parts[0].text.strip().split("\n")[0].strip().rstrip(".").strip()
    assert asked == ["Who runs Velloria's harbour?", f"Where does {first} live?"]  # the hop retrieved on its own
    hop_sources = [s.id for s in got.parts[1].sources]
    assert hop_sources == [s.id for s in retrieve(asked[1], top_k=2)]
    assert {s.id for s in got.sources} == {s.id for p in got.parts for s in p.sources}  # every chunk read, once
    assert got.composed == "hops" and got.text == " ".join(got.parts[1].text.split())  # what the last hop found


def test_a_comparison_without_numbers_is_asked_whole_over_its_parts_answers(kv):
    question = "Which was founded earlier, Wynton or Quenmouth?"
    got = kv.answer(question, STRATEGY_CHUNKS, parts="auto", strategy="target_recompute", max_new_tokens=3)
    if decide(split(question), [p.text for p in got.parts[:2]]) is not None:
        pytest.skip("the tiny model's answers stated numbers")  # its output is bytes of a random model
    assert got.composed == "model" and len(got.parts) == 3
    judged = got.parts[2]
    assert judged.stats.strategy == "full_prefill" and judged.text == got.text
    assert judged.stats.context_tokens > 0 and judged.sources == []
    assert got.to_dict()["composed"] == "model"


def test_a_default_that_splits_is_applied_when_no_strategy_is_named(kv, monkeypatch):
    from kvrag.plan import defaults

    split_default = {"strategy": "target_recompute", "picker": None, "budget": 0.05, "parts": "auto"}
    monkeypatch.setitem(defaults.SHIPPED, kv.fingerprint.weights, split_default)
    whole = "When does the archive open, and what do cats hunt?"
    got = kv.answer(whole, STRATEGY_CHUNKS, max_new_tokens=3)
    assert len(got.parts) == 2 and got.stats.strategy == "target_recompute"
    named = kv.answer(whole, STRATEGY_CHUNKS, strategy="target_recompute", max_new_tokens=3)
    assert named.parts == []  # a strategy named by the caller answers whole unless parts= says otherwise


def test_stream_and_answers_over_given_chunks_take_parts_too(kv):
    from tiny import HashEmbedder

    from kvrag import KVRAG
    from kvrag.cache.store import MemoryStore
    from kvrag.engine.documents import Document

    rag = KVRAG(kv, embedder=HashEmbedder(), store=MemoryStore())
    rag.ingest([Document(text, meta) for text, meta in FACTS], split=False, progress=False)
    question = "Who built the lighthouse of Karsa, and who runs Velloria's harbour?"
    options = dict(parts="auto", top_k=4, strategy="target_recompute", max_new_tokens=4)
    *pieces, answer = rag.stream(question, **options)
    assert len(answer.parts) == 2 and "".join(pieces) == answer.text  # the composed text, one piece
    assert answer.token_ids == rag.query(question, **options).token_ids
    texts = [text for text, _ in FACTS]
    over = rag.answer(question, texts, parts="auto", strategy="target_recompute", max_new_tokens=4)
    assert len(over.parts) == 2 and all([s.text for s in p.sources] == texts for p in over.parts)
    whole = rag.answer(question, texts, strategy="target_recompute", max_new_tokens=4)
    assert whole.parts == []  # a strategy named and no parts asked: whole


def test_a_models_list_of_parts_is_read_strictly_and_else_the_question_is_whole():
    from kvrag.plan.parts import parsed

    question = "Which cargo does the Velia carry, and who captains the Orn?"
    reply = "1. Which cargo does the Velia carry?\n2. Who captains the Orn?\n"
    assert [p.question for p in parsed(reply, question)] == ["Which cargo does the Velia carry?",
                                                             "Who captains the Orn?"]
    assert parsed("- What is it?\n- Who is he?", question) is None  # names nothing the question names
    assert parsed(question, question) is None  # one question: whole
    assert parsed("Which cargo does the Velia carry?\nSure, here you go.", question) is None  # not a list
    assert parsed("\n".join(f"Is the Velia {i}?" for i in range(5)), question) is None  # too many
    with pytest.raises(InvalidRequestError, match='give "auto", "model" or a list'):
        resolve_parts(question, "everything")


def test_parts_by_the_model_run_its_own_generation_and_fall_back_to_whole(kv, monkeypatch):
    from kvrag.answer import Answer, AnswerStats
    from kvrag.run import parts as run_parts

    asked = []

    def reply(text):
        def stream_prompt(ids, **sampling):
            asked.append(kv.tokenizer.decode(ids))
            yield Answer(text, [], "stop", AnswerStats.of_prompt(len(ids), 0, 0.0, 0.0))

        return stream_prompt

    question = "When does the archive open, and what do cats hunt?"
    monkeypatch.setattr(kv, "stream_prompt", reply("When does the archive open?\nWhat do cats hunt?"))
    got = kv.answer(question, STRATEGY_CHUNKS, parts="model", strategy="target_recompute", max_new_tokens=3)
    assert len(asked) == 1 and question in asked[0]
    assert [p.stats.strategy for p in got.parts] == ["target_recompute"] * 2
    auto = kv.answer(question, STRATEGY_CHUNKS, parts="auto", strategy="target_recompute", max_new_tokens=3)
    assert got.token_ids == auto.token_ids  # the same parts as the built-in splitter's: the same answers
    monkeypatch.setattr(kv, "stream_prompt", reply("I cannot split that."))
    whole = kv.answer(question, STRATEGY_CHUNKS, parts="model", strategy="target_recompute", max_new_tokens=3)
    assert whole.parts == [] and run_parts.model_parts(kv, question, kv.stream_prompt) is None
