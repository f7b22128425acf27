"""llama.cpp beside kvrag on the same GGUF: full prefill at ~1k and ~4k tokens (more sizes as a second argument,
e.g. 1000,4000,8000; sizes over 4k are timed once), and ms a decoded token, 2 threads."""
import json
import statistics
import sys
import time
from importlib import resources
from pathlib import Path
from llama_cpp import Llama
from kvrag.model import catalog

name = sys.argv[1]
model = catalog.named(name)
paths = catalog.check_parts(model)
if len(paths) == 1:
    gguf = paths[0]
else:
    gguf = Path(f"{model.title}.{model.quant}.gguf")
    if not gguf.exists():
        catalog._copy_checked(model, paths, gguf)
text = (resources.files("kvrag") / "data" / "python_docs" / "api_entries.jsonl").read_text()[:200000]
llm = Llama(model_path=str(gguf), n_ctx=8192, n_threads=2, n_threads_batch=2, n_batch=512, verbose=False)
tokens = llm.tokenize(text.encode(), add_bos=False)
out = {"model": name, "gguf": gguf.name, "threads": 2, "runs": []}
sizes = [int(s) for s in sys.argv[2].split(",")] if len(sys.argv) > 2 else [1000, 4000]
for size in sizes:
    prompt = tokens[:size]
    times = []
    for run in range(3 if size <= 4000 else 1):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        times.append(time.perf_counter() - t0)
    steps = []
    tok = int(llm.sample(temp=0.0)) if hasattr(llm, "sample") else 0
    for i in range(32):
        t0 = time.perf_counter()
        llm.eval([tok])
        steps.append(time.perf_counter() - t0)
        tok = int(llm.sample(temp=0.0)) if hasattr(llm, "sample") else tok
    out["runs"].append({"context_tokens": size, "prefill_s": statistics.median(times), "prefill_runs": times,
                        "decode_ms": 1000 * statistics.median(steps)})
    print(out["runs"][-1], flush=True)
Path(f"{name}.json").write_text(json.dumps(out, indent=1))
