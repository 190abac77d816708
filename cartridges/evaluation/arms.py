"""The eval's arm names, in the order they are scored (kept light: the CLI reads them for `--skip`)."""

PEERS = ("knorm", "snapkv", "first")  # compression peers at the cartridge's rows
RAG = {"rag": "bm25", "rag_dense": "dense"}  # arm -> retriever over the corpus's chunks
ARMS = ("bare", "icl", "full_kv", "icl_window", "cartridge", *PEERS, *RAG, "fleet_retrieval", "fleet_oracle")
