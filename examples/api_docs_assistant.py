"""An API-documentation assistant over the Python standard-library docs, in a LlamaIndex pipeline.

    python examples/api_docs_assistant.py [--quick]

The bundled excerpt of the Python 3.11 docs (kvrag/data/python_docs, PSF license) goes through a
LlamaIndex IngestionPipeline: SentenceSplitter, kvrag's KV transform (each node's KV encoded once and
stored) and kvrag's embedder, into a VectorStoreIndex. Questions then go to KVRAGQueryEngine over that
index's retriever, streaming; each answer is printed with its time to first token beside full prefill's
over the same retrieved nodes. Offline, on the embedded default model.
"""

from __future__ import annotations

import argparse
import time

import torch
from llama_index.core import Document, VectorStoreIndex
from llama_index.core.ingestion import IngestionPipeline
from llama_index.core.node_parser import SentenceSplitter
from llama_index.embeddings.kvrag import KVRAGEmbedding
from llama_index.query_engine.kvrag import KVRAGKVTransform, KVRAGQueryEngine

from kvrag import KVRAG, KVModel, MemoryStore
from kvrag.lab.demo import sample_docs
from kvrag.engine.embed import Embedder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one question (for tests)")
    parser.add_argument("--top-k", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    embedder = Embedder()
    rag = KVRAG(KVModel.from_pretrained(), embedder=embedder, store=MemoryStore())
    chunks, questions = sample_docs()
    documents = [Document(text=c["text"], metadata={"page": c["source"]}, id_=c["id"]) for c in chunks]
    embed = KVRAGEmbedding(embedder)
    t0 = time.perf_counter()
    pipeline = IngestionPipeline(
        transformations=[SentenceSplitter(chunk_size=256, chunk_overlap=0), KVRAGKVTransform(rag), embed]
    )
    nodes = pipeline.run(documents=documents)
    print(
        f"ingested {len(nodes)} nodes from {len({c['source'] for c in chunks})} pages in "
        f"{time.perf_counter() - t0:.1f} s (KV of {len(rag.store)} nodes stored)\n"
    )
    index = VectorStoreIndex(nodes, embed_model=embed)  # the one index of the nodes; kvrag's store holds their KV
    generation = dict(similarity_top_k=args.top_k, max_new_tokens=48, stop=["\n\n"])
    kvrag_engine = KVRAGQueryEngine.from_index(index, rag, streaming=True, **generation)
    reference = KVRAGQueryEngine.from_index(index, rag, strategy="full_prefill", **generation)

    for item in questions[: 1 if args.quick else 3]:
        print(f"Q: {item['question']}")
        response = kvrag_engine.query(item["question"])
        print("   kvrag        | ", end="", flush=True)
        for piece in response.response_gen:
            print(piece, end="", flush=True)
        stats = response.metadata["kvrag"]
        full = reference.query(item["question"])
        print(f"\n   full prefill | {full.response.strip()}")
        print(
            f"   ttft: kvrag {stats['ttft_s']:.3f} s ({stats['strategy']}, {stats['recomputed_tokens']} of "
            f"{stats['context_tokens']} context tokens recomputed), full prefill "
            f"{full.metadata['kvrag']['ttft_s']:.3f} s; sources: "
            f"{', '.join(n.node.metadata['page'] for n in response.source_nodes)}\n"
        )


if __name__ == "__main__":
    main()
