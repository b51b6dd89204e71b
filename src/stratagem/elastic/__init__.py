"""Elastic jobs on torch's own elastic machinery (``torch.distributed.elastic``): the agent
that runs ``stratagem run -n MIN:MAX`` (``agent.py``), and torch's dynamic rendezvous over the
job's store sealed with its secret (``sealed_rendezvous.py``), also torch's rendezvous backend
``"stratagem"`` for ``torchrun --rdzv-backend stratagem`` (``torchrun_backend.py``, which
imports nothing of torch). Imported only by the launcher's elastic path, which needs torch."""
