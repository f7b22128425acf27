"""The benches on a tiny model folder: decode rows timed alone, every bench's output ending with the process's memory
high-water mark, and the decode bench's reads sharing one buffer.

Structure only: speed and memory figures live in docs/performance.md, never in assertions.
"""

import pytest
from tiny import save_tiny

from kvrag.cli import main


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("model"))


def test_decode_rows_can_be_timed_alone_and_each_row_says_the_peak_memory(model, capsys):
    from kvrag.cpu import ckernel
    from kvrag.lab.bench.decode import decode_benchmark
    from kvrag.model.kvmodel import KVModel

    kv = KVModel.from_pretrained(str(model))
    wanted = ["transformers_step", "kvrag", "memory_read"] if ckernel.available() else ["transformers_step"]
    (row,) = decode_benchmark(kv, contexts=(150,), tokens=4, runs=1, rows=wanted, log=print)
    assert set(row["ms_per_token"]) == set(wanted) and row["peak_memory"]["rss_high_water_mb"] > 0
    assert "peak memory:" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown decode rows"):
        decode_benchmark(kv, contexts=(150,), rows=["kvrag_fast"], log=print)


def test_the_quantized_reads_read_the_front_of_one_buffer_made_again_each_round(model, monkeypatch):
    from kvrag.lab.bench import decode as bench_decode
    from kvrag.model.kvmodel import KVModel

    kv = KVModel.from_pretrained(str(model))
    reader = bench_decode._MemoryRead(kv)
    smaller = bench_decode._MemoryRead(kv, less=1 << 12, shared=reader)
    if not reader.runs():
        pytest.skip("no C kernels here")
    reader.cached = smaller.cached = 100
    reader(4)
    whole = reader.buffer
    smaller(4)
    assert reader.buffer is whole and smaller.buffer.numel() == 0  # read from the model's reader's buffer
    reader.release()
    assert reader.buffer.numel() == 0
    smaller(4)  # the first read of a round makes it again, as large as the read needs
    assert reader.buffer.numel() > 0


def test_bench_decode_ends_with_the_peak_memory_and_refuses_an_unknown_row(model, capsys):
    code = main(["bench-decode", "--model", str(model), "--contexts", "150", "--tokens", "4", "--runs", "1",
                 "--rows", "transformers_step"])
    out = capsys.readouterr().out
    assert code == 0 and "transformers_step" in out and "kvrag_torch" not in out
    assert out.rstrip().splitlines()[-1].startswith("peak memory: ") and "MiB resident" in out
    assert main(["bench-decode", "--model", str(model), "--rows", "kvrag,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown rows ['nope']" in err and err.count("\n") == 1
