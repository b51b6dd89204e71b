"""Parameter servers: the ps task's shard store (``server``) and the worker's side of it (``client``)."""
