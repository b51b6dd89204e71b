"""The machinery the strategies share: contexts, scope hooks, per-replica values, devices,
replica threads, mirrored variables, distributed input and loss scaling.

The strategies themselves are the ``*_strategy.py`` files one level up; each reads top to
bottom and takes from here what it needs.
"""
