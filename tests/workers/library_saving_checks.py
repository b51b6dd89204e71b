"""A Hugging Face GPT-2 (default config: tied embeddings, a cache in its output) trained with
``Model.fit`` under MultiWorkerMirroredStrategy, saved, and loaded back by its class on every
worker; see tests/test_library_models_saving.py, which starts it and checks what it writes.

argv: OUT. The chief writes the trained model's predictions (``torch.save``, read back with
``weights_only=True``); every worker writes what its own load predicted.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import stratagem as sg
from real_models import hf_models

OUT = Path(sys.argv[1])
TOKENS = hf_models.tokens(8, seed=30)

strategy = sg.distribute.MultiWorkerMirroredStrategy()
rank = strategy.cluster_resolver.task_id
with strategy.scope():
    model = sg.keras.Model(hf_models.gpt2(seed=rank))  # the chief's initial values win
    model.compile(optimizer=sg.keras.optimizers.SGD(0.5))  # no loss: the model's own
model.fit(TOKENS, TOKENS, batch_size=4, epochs=1, shuffle=False, verbose=0)
path = model.save(str(OUT / "gpt2"))  # every worker calls it; it returns once written
with strategy.scope():
    loaded = sg.keras.models.load_model(path, allow_packages=("transformers",))
assert loaded.module.lm_head.weight is loaded.module.transformer.wte.weight
# predict is collective under the strategy: every worker calls both.
results = {
    name: torch.from_numpy(m.predict(TOKENS))
    for name, m in [("loaded", loaded), ("trained", model)]
}
torch.save(results, OUT / f"worker{rank}.pt")
print("done", flush=True)
