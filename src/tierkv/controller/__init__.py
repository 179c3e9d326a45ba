"""Controller mode: one `tierkv controller` process that knows which server holds which key
(the directory of a cluster of servers, and the answer for KV-aware routers)."""
