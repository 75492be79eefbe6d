"""Disaggregation: the recipe table, instances with roles, in one process or one each.

``recipes`` says which pool calls run at each hook of a request; ``cluster`` steps every
instance in one process; ``runtime``, ``instance`` and ``rpc`` run one process per
instance over a ZeroMQ control plane, writing KV into a peer's shared pool tensor
(:mod:`minimemserve.mempool.shared`). The package imports none of them."""
