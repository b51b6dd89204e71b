"""One script for every task of ``stratagem run -n 2 --evaluator``: the workers fit the digits
MLP under MultiWorkerMirroredStrategy, the chief saving a checkpoint each epoch
(``ModelCheckpoint("ckpt/ckpt-{epoch}")``); the evaluator task follows them with
``SidecarEvaluator`` and writes what it evaluated to ``evaluations.json``.

So that the test sees the evaluator follow the training checkpoint by checkpoint (rather than
find only the last one, when training outruns it), the chief waits after each save until the
evaluator has evaluated it: the evaluator marks each evaluation it finishes with a file."""

import json
import os
import time

import torch

import stratagem as sg

EPOCHS, TRAIN, TEST, GLOBAL_BATCH = 3, 256, 96, 64


def digits():
    (x, y), (x_test, y_test) = sg.data.datasets.load_digits(image_size=8)

    def prepare(a):
        return torch.from_numpy(a).reshape(len(a), -1).float() / 255

    return (prepare(x[:TRAIN]), torch.from_numpy(y[:TRAIN])), (
        prepare(x_test[:TEST]),
        torch.from_numpy(y_test[:TEST]),
    )


def build_model() -> sg.keras.Model:
    module = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    return sg.keras.Model(module)


def compile_model(model: sg.keras.Model) -> None:
    model.compile(
        sg.keras.optimizers.Adam(0.01),
        sg.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        ["accuracy"],
    )


class MarkEvaluations(sg.keras.callbacks.Callback):
    """The evaluator's side: ``evaluated-<k>`` once its k-th evaluation ended."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def on_test_end(self, logs=None):
        self.count += 1
        with open(f"evaluated-{self.count}", "w") as f:
            f.write(json.dumps(logs))


class AwaitEvaluation(sg.keras.callbacks.Callback):
    """The chief's side, after ModelCheckpoint's save of each epoch: wait (at most 60 s) until
    the evaluator has evaluated as many checkpoints as were saved."""

    def on_epoch_end(self, epoch, logs=None):
        if not sg.keras.callbacks.is_chief(self.model):
            return
        deadline = time.monotonic() + 60
        while not os.path.exists(f"evaluated-{epoch + 1}"):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the evaluator did not evaluate ckpt-{epoch + 1} in 60 s")
            time.sleep(0.05)


def main() -> None:
    train, test = digits()
    resolver = sg.distribute.cluster_resolver.TFConfigClusterResolver()
    if resolver.task_type == "evaluator":
        # Its own process, with no strategy of the training's: the default one.
        model = build_model()
        compile_model(model)
        evaluator = sg.keras.utils.SidecarEvaluator(
            model, test, "ckpt", max_evaluations=EPOCHS, callbacks=[MarkEvaluations()], timeout=120
        )
        evaluator.poll_secs = 0.1
        evaluator.start()
        report = {
            "epochs": EPOCHS,
            "steps_per_epoch": TRAIN // GLOBAL_BATCH,
            "evaluations": [
                {
                    "path": e.path,
                    "number": e.number,
                    "step": e.step,
                    "logs": e.logs,
                    "replicas": model.distribute_strategy.num_replicas_in_sync,
                }
                for e in evaluator.evaluations
            ],
        }
        with open("evaluations.json", "w") as f:
            json.dump(report, f)
        return
    torch.manual_seed(0)
    strategy = sg.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build_model()
    compile_model(model)
    save = sg.keras.callbacks.ModelCheckpoint("ckpt/ckpt-{epoch}")
    model.fit(*train, batch_size=GLOBAL_BATCH, epochs=EPOCHS, shuffle=False, verbose=0,
              callbacks=[save, AwaitEvaluation()])  # fmt: skip


if __name__ == "__main__":
    main()
