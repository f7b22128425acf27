"""Time to first token on vLLM (float32): its own full prefill, an exact prefix-cache hit, the floor (the target and
the suffix over an exact cache hit of the head), `reuse` and `target_recompute` through kvrag's connector, beside
kvrag's transformers path. One process; run it alone.

    HF_HUB_OFFLINE=1 .venv-vllm/bin/python integrations/vllm-kvrag/bench_ttft.py [MODEL_FOLDER] [1000,4000]

MODEL_FOLDER defaults to kvrag's converted embedded model. Each connector run starts with vLLM's prefix cache
reset: a later run of the same plan would otherwise hit the blocks the first one left cached.
"""

import statistics, sys, tempfile, time

if __name__ == "__main__":
    import torch
    from vllm import LLM
    from kvrag import KVModel, Request, pipeline
    from kvrag.bench import context_texts
    from kvrag.chunks import ChunkSource
    from kvrag.store import DiskStore
    from vllm_kvrag.executor import VLLMExecutor, connector_config
    from kvrag.model import convert_default

    folder = sys.argv[1] if len(sys.argv) > 1 else str(convert_default()[0])
    sizes, runs = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1000,4000").split(",")], 3
    root = tempfile.mkdtemp()
    kv = KVModel.from_pretrained(folder, dtype="float32")
    llm = LLM(
        model=folder,
        dtype="float32",
        max_model_len=8192,
        block_size=32,
        enforce_eager=True,
        gpu_memory_utilization=0.15,
        kv_transfer_config=connector_config({"store": "disk", "path": root, "storage_dtype": "float32"}),
    )
    store = DiskStore(root, "float32")
    ex = VLLMExecutor(kv, llm, store)
    q = "What does the documentation say about the first topic?"
    print(f"threads {torch.get_num_threads()}", flush=True)
    for size in sizes:
        texts = context_texts(kv, size, 200)
        ChunkSource(kv, store).chunks(texts).kv()  # stored once, not timed

        def ttft(strategy, executor=ex):
            request = Request.of(q, texts, strategy=strategy, target=0, max_new_tokens=1)
            chunks = ChunkSource(kv, store).chunks(request.chunks)
            *_, a = pipeline.stream(kv, request, chunks, executor, started_at=time.perf_counter())
            return a.stats.ttft_s, a.stats.context_tokens

        out = {}
        for name, fn in [
            ("vllm full_prefill", lambda: ttft("full_prefill")),
            ("vllm full_prefill, exact prefix-cache hit", lambda: ttft("full_prefill")),
            ("vllm reuse", lambda: ttft("reuse")),
            ("vllm target_recompute", lambda: ttft("target_recompute")),
            ("hf full_prefill", lambda: ttft("full_prefill", kv.executor)),
            ("hf target_recompute", lambda: ttft("target_recompute", kv.executor)),
        ]:
            if name == "vllm full_prefill":
                llm.reset_prefix_cache()
                times = []
                for _ in range(runs):
                    llm.reset_prefix_cache()
                    times.append(fn()[0])
            elif name == "vllm full_prefill, exact prefix-cache hit":
                fn()  # the prompt is now cached
                times = [fn()[0] for _ in range(runs)]
            else:
                fn()  # warm
                times = []
                for _ in range(runs):  # no run may hit the blocks an earlier run of the same plan left cached
                    llm.reset_prefix_cache()
                    times.append(fn()[0])
            out[name] = statistics.median(times)
        from vllm import SamplingParams

        ids = (
            kv.layout.prefix_ids
            + [t for c in [*texts[1:], texts[0]] for t in kv.layout.chunk_ids(c)]
            + kv.layout.suffix_ids(q)
        )
        head = len(kv.layout.prefix_ids) + sum(len(kv.layout.chunk_ids(c)) for c in texts[1:])
        one = SamplingParams(max_tokens=1, temperature=0)
        times = []
        for r in range(runs + 1):
            llm.reset_prefix_cache()
            llm.generate([{"prompt_token_ids": ids[:head]}], one, use_tqdm=False)  # the head, cached exactly
            t0 = time.perf_counter()
            llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)  # computes the target and the suffix
            times.append(time.perf_counter() - t0)
        out["vllm target+suffix over an exact prefix-cache hit"] = statistics.median(times[1:])
        ctx = ttft("reuse")[1]
        print(f"{ctx} context tokens: " + ", ".join(f"{k} {v:.3f} s" for k, v in out.items()), flush=True)
