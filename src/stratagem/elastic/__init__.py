"""Elastic jobs on torch's own elastic machinery (``torch.distributed.elastic``): the agent
that runs ``stratagem run -n MIN:MAX`` (``agent.py``). Imported only by the launcher's elastic
path, which needs torch."""
