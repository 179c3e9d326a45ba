"""The tierkv server: request handlers (service), the RPC loop (rpc), process wiring (app)."""
