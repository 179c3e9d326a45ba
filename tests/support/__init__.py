"""Helpers shared by the tests: real server processes, real services (redis-server, an S3
server), cluster nodes, HTTP, an in-memory tier, the vLLM engine. ``tests/`` is on the path
(pytest's ``pythonpath``), so tests import them as ``support.<module>``."""
