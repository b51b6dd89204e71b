"""Parameter servers: the ps task's shard store (``server``) and a worker's side of it
(``client``).
"""
