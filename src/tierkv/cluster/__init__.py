"""Cross-node sharing: several servers share their pools through a consistent-hash directory.

``ring`` decides which members own a key's directory entry, ``membership`` keeps the member
list (seeds, heartbeats, TTL, rejoin), ``directory`` holds and moves the entries, ``transport``
moves chunk bytes between pools, ``peer_tier`` makes remote chunks a tier of the prefetch,
and ``node`` wires them together for one server.
"""
