"""kvrag logs under the `kvrag` logger (nothing printed by a library call); the CLI's -v shows it on stderr."""

from __future__ import annotations

import logging

from tiny import STRATEGY_CHUNKS, STRATEGY_QUESTION

from kvrag.cache.chunks import ChunkSource
from kvrag.cache.store import MemoryStore
from kvrag.cli.main import build_parser, log_to_stderr


def test_an_answer_logs_the_plan_it_ran_and_prints_nothing(kv, caplog, capsys):
    with caplog.at_level(logging.INFO, logger="kvrag"):
        kv.answer(STRATEGY_QUESTION, STRATEGY_CHUNKS, strategy="target_recompute", target=2, max_new_tokens=2)
    plans = [r.getMessage() for r in caplog.records if r.name == "kvrag.run.pipeline"]
    assert len(plans) == 1 and "strategy target_recompute" in plans[0] and "target 2" in plans[0]
    assert capsys.readouterr() == ("", "")


def test_the_default_plan_says_which_strategy_the_default_chose(kv, caplog):
    with caplog.at_level(logging.INFO, logger="kvrag"):
        kv.answer(STRATEGY_QUESTION, STRATEGY_CHUNKS, max_new_tokens=2)
    plans = [r.getMessage() for r in caplog.records if r.name == "kvrag.run.pipeline"]
    assert plans and all("strategy None" not in p for p in plans)  # the default was applied before planning


def test_the_chunks_read_log_at_debug(kv, caplog):
    with caplog.at_level(logging.DEBUG, logger="kvrag"):
        ChunkSource(kv, MemoryStore()).chunks(STRATEGY_CHUNKS[:2]).kv([0, 1])  # missed, encoded, stored
    read = [r.getMessage() for r in caplog.records if r.name == "kvrag.cache.chunks"]
    assert any("missed" in m for m in read) and any("encoded" in m for m in read)


def test_verbose_counts_on_every_command_and_turns_the_kvrag_logger_on(monkeypatch):
    assert build_parser().parse_args(["models"]).verbose == 0
    assert build_parser().parse_args(["models", "-vv"]).verbose == 2
    log = logging.getLogger("kvrag")
    monkeypatch.setattr(log, "handlers", list(log.handlers))
    monkeypatch.setattr(log, "level", log.level)
    log_to_stderr(1)
    log_to_stderr(1)  # once: a second call adds no second handler
    assert log.level == logging.INFO and [h.get_name() for h in log.handlers].count("kvrag-cli") == 1
