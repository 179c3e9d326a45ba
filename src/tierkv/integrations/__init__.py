"""Engine integrations: connectors that let inference engines use a tierkv server.

``tierkv.integrations.vllm`` holds the vLLM KV connector (``TierKVConnector``). Each
integration imports its engine lazily, so importing this package needs no engine installed.
"""
