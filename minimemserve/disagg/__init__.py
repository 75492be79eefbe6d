"""Disaggregation: instances with roles, in one process or one each.

The pool calls at each hook of a request are :mod:`minimemserve.recipes`; ``cluster`` steps every
instance in one process; ``runtime``, ``instance`` and ``rpc`` run one process per
instance over a ZeroMQ control plane, writing KV into a peer's shared pool tensor
(:mod:`minimemserve.mempool.shared`). The package imports none of them."""
