"""`tierkv demo`: simulated inference engines running a Long-Doc-QA workload against tierkv.

Also the example of an engine integration. The modules, in reading order:

- :mod:`.kv`: the simulated model's KV layout and a deterministic stand-in for its forward
  pass, so every chunk loaded from the cache is verified byte for byte;
- :mod:`.engine`: a paged KV cache in numpy and the lookup / retrieve / prefill / store
  flow of one request, with one-copy ``gather``/``scatter`` callbacks;
- :mod:`.workload`: the documents, questions and rounds;
- :mod:`.report`: progress bar and final report;
- :mod:`.engines`: the engine processes running a workload, gathered into a report;
- :mod:`.sizing`: the working set and the pool sizes the demo picks;
- :mod:`.local_server`: the throw-away server of ``--with-server``;
- :mod:`.cluster`: two clustered servers, node B's engines reading node A's chunks;
- :mod:`.runner`: the command line, one function per demo mode.
"""

from tierkv.demo.fleet import run_demo
from tierkv.demo.runner import add_demo_arguments, run_demo_command

__all__ = ["add_demo_arguments", "run_demo", "run_demo_command"]
