"""The engine: documents in, answers out. `KVRAG` (rag.py) ingests documents (documents.py) into an index folder
(folder.py, index.py), scores chunks against a question (embed.py) and hands the retrieved chunks to a `KVModel`;
aio.py bridges its blocking calls to asyncio."""
