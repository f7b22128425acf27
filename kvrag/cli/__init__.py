"""The `kvrag` command line, a module a command group: models (demo, models), index (ingest, info, gc), ask,
bench, study (study, study-compare, agree, tune); common holds what they share and main the parser and exit codes."""

from kvrag.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
