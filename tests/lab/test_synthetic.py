"""Synthetic worlds: determinism, answers in (and only in) their target, dialogue updates, sizes. No model."""

import re
from collections import Counter

import pytest

from kvrag import InvalidRequestError
from kvrag.lab.synthetic import dialogue, encyclopedia

SEEDS = [0, 1, 7]
# Sizes are checked in whitespace words: the default model's tokenizer gives 1.3-1.9 tokens a word on these
# texts (measured over 20 seeds), so these ranges keep articles in ~80-200 tokens and sessions in ~80-250.
ARTICLE_WORDS = (50, 110)
SESSION_WORDS = (55, 150)


def words(text):
    return len(text.split())


def test_same_seed_same_world_other_seed_another():
    assert encyclopedia(seed=3) == encyclopedia(seed=3)
    assert dialogue(seed=3) == dialogue(seed=3)
    assert encyclopedia(seed=3) != encyclopedia(seed=4)
    assert dialogue(seed=3) != dialogue(seed=4)


@pytest.mark.parametrize("seed", SEEDS)
def test_encyclopedia_answers_are_in_their_target_only(seed):
    articles, questions = encyclopedia(seed=seed)
    assert len(articles) == 40 and len({a.id for a in articles}) == 40
    assert len({q.id for q in questions}) == len(questions) >= 4 * 40
    by_id = {a.id: a for a in articles}
    for q in questions:
        target = by_id[q.target]
        assert q.answers and q.question.endswith("?")
        assert target.title.lower() in q.question.lower()  # the question names its entity
        for answer in q.answers:
            assert answer.lower() in target.text.lower(), (q, target.text)
            others = [a.id for a in articles if a.id != q.target and answer.lower() in a.text.lower()]
            assert not others, (q, others)


@pytest.mark.parametrize("seed", SEEDS)
def test_encyclopedia_articles_have_same_kind_distractors_and_sizes(seed):
    articles, questions = encyclopedia(seed=seed)
    per_article = Counter(q.target for q in questions)
    assert all(4 <= per_article[a.id] <= 6 for a in articles)  # 4-6 facts an article, each asked once
    kind_of = {q.target: q.family.split("/")[0] for q in questions}
    entities_per_kind = Counter(kind_of.values())
    assert set(entities_per_kind) == {"town", "river", "person", "ship", "company"}
    assert min(entities_per_kind.values()) >= 5  # several of every kind: distractors of the target's kind
    for a in articles:
        assert ARTICLE_WORDS[0] <= words(a.text) <= ARTICLE_WORDS[1], (a.id, words(a.text))


def test_small_and_impossible_sizes():
    articles, questions = encyclopedia(seed=0, entities=5)
    assert len(articles) == 5 and {q.target for q in questions} == {a.id for a in articles}
    sessions, questions = dialogue(seed=0, sessions=1)
    assert len(sessions) == 1 and all(q.target == "s00" for q in questions)
    with pytest.raises(InvalidRequestError):
        dialogue(sessions=0)
    with pytest.raises(InvalidRequestError):
        encyclopedia(entities=10_000)


def stating(sessions, question):
    """Indices of the sessions whose assistant note states the question's fact, read from the text alone."""
    noun = re.fullmatch(r"What is (.+?)( now)?\?", question.question).group(1).replace(" my ", " your ")
    return [i for i, s in enumerate(sessions) if f"Noted: {noun} is " in s.text]


@pytest.mark.parametrize("seed", SEEDS)
def test_dialogue_target_is_the_latest_statement(seed):
    sessions, questions = dialogue(seed=seed, sessions=12)
    assert [s.id for s in sessions] == [f"s{n:02d}" for n in range(12)]
    assert len({q.id for q in questions}) == len(questions) >= 6
    index = {s.id: n for n, s in enumerate(sessions)}
    families = Counter(q.family for q in questions)
    assert families["user-update"] >= 1 and families["other-single"] + families["other-update"] >= 3
    for q in questions:
        target = sessions[index[q.target]]
        states = stating(sessions, q)
        assert states and states[-1] == index[q.target], (q, states)
        notes = [line for line in target.text.splitlines() if line.startswith("Assistant: Noted: ")]
        assert any(all(a in line for a in q.answers) for line in notes), (q, target.text)
        if q.family.endswith("-update"):
            assert len(states) >= 2  # stated before with another value, then updated
            older = sessions[states[-2]].text
            assert not any(a.lower() in older.lower() for a in q.answers)
        else:
            assert len(states) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_dialogue_has_hard_distractors_and_sizes(seed):
    sessions, questions = dialogue(seed=seed)
    for q in questions:
        # another session states the same kind of fact (about someone else, or an older value)
        kind = "name of" if "name of" in q.question else ("home city of" if "home city" in q.question else "job of")
        assert any(kind in s.text for s in sessions if s.id != q.target), q
    user_city = next(q for q in questions if q.question == "What is the home city of the user now?")
    assert any("home city of your" in s.text for s in sessions)  # other people's cities too
    assert user_city.family.startswith("user-")
    for s in sessions:
        assert SESSION_WORDS[0] <= words(s.text) <= SESSION_WORDS[1], (s.id, words(s.text))
        assert s.text.startswith(f"Session {int(s.id[1:]) + 1},")
