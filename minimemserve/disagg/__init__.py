"""Disaggregation across processes: instances with roles, one process (or Ray actor) each.

The pool calls at each hook of a request are :mod:`minimemserve.recipes`;
:mod:`minimemserve.inprocess` steps every instance in one process; ``runtime``, ``instance`` and
``rpc`` run one process per instance over a ZeroMQ control plane, writing KV into a peer's
shared pool tensor (:mod:`minimemserve.mempool.shared`). The package imports none of them."""
