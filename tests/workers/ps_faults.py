"""Faults in a parameter-server job (launched by the test through ``stratagem run``).

argv: fault [checkpoint_dir].

- ``lost-worker``: async with bounded staleness (so the survivors would wait for the lost
  worker if the ps did not notice it is gone); the last worker SIGKILLs itself after 3 steps,
  the others train 30 steps and the chief prints what the ps applied.
- ``lost-ps``: async; the chief checkpoints after step 10 and, in the launcher's first attempt,
  then kills the ps (by the pid it signed in with at the roll call). The next push fails
  naming the ps; the restarted job restores step 10 (values and momentum sent back to the new
  ps), writes the checkpoint again as the ps now holds it (``roundtrip``), and trains to 30.
- ``returning-worker``: sync, 3 workers (``-n 2:3 --restart-workers 1``); each trains while
  the ps has applied fewer than 30 updates. The last worker SIGKILLs itself at its 4th step in
  its first incarnation; the launcher starts it again, and it is taken back. The others wait
  after update 10 until the ps counts 3 workers training again (so the return lands at the same
  update on every run); the chief prints what the ps applied, per update.
- ``stopped-worker``: sync; the last worker stops itself (SIGSTOP) after 3 steps: the others'
  next push waits for its gradient, and ends after the operation timeout naming it.
- ``evaluator``: an evaluator task pulls the parameters and evaluates while the workers train
  (they start once it has pulled the initial values: a file it writes), until they are done.
"""

import os
import signal
import sys
import time

import torch

import stratagem as sg
from workers.common import build_model


def wait_for(path, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout} s")
        time.sleep(0.05)


fault = sys.argv[1]
bound = 1 if fault == "lost-worker" else None
mode = "sync" if fault in ("stopped-worker", "returning-worker") else "async"
strategy = sg.distribute.ParameterServerStrategy(mode=mode, max_staleness=bound)
resolver = strategy.cluster_resolver
chief = strategy.extended.should_checkpoint
last = resolver.cluster_spec().num_tasks("worker") - 1
with strategy.scope():
    model = build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
step = torch.tensor(0)
if fault == "lost-ps":
    directory = sys.argv[2]
    checkpoint = sg.train.Checkpoint(model=model, optimizer=optimizer, step=step)
    manager = sg.train.CheckpointManager(checkpoint, directory, max_to_keep=1)
    latest = sg.train.latest_checkpoint(directory)
    if latest:
        checkpoint.restore(latest)
        print(f"restored {os.path.basename(latest)} at step {int(step)}", flush=True)
        if chief:
            sg.train.Checkpoint(model=model, optimizer=optimizer).write(
                os.path.join(directory, "roundtrip")
            )
        else:  # let the chief read back what the ps holds before anyone trains on
            wait_for(os.path.join(directory, "roundtrip"))
if fault == "evaluator":
    ready = os.path.join(sys.argv[2], "evaluator-ready")
    if resolver.task_type == "evaluator":
        x, y = torch.randn(64, 5), torch.randint(0, 3, (64,))
        losses = []
        while True:
            finished = strategy.training_finished()  # before the pull: that pull is the last
            strategy.pull()
            with torch.no_grad():
                losses.append(float(torch.nn.functional.cross_entropy(model(x), y)))
            if len(losses) == 1:
                open(ready, "w").close()
            if finished:
                break
        print(f"evaluator: {len(losses)} evaluations, first {losses[0]:.6f} last {losses[-1]:.6f}")
        sys.exit(0)
    wait_for(ready)
g = torch.Generator().manual_seed(resolver.task_id * 1000 + int(step))
first_attempt = os.environ.get("STRATAGEM_RESTART_COUNT") == "0"
if fault == "returning-worker":
    first_incarnation = os.environ.get("STRATAGEM_TASK_INCARNATION", "1") == "1"
    while (updates := strategy.ps_stats()[0]["steps"]) < 30:
        if resolver.task_id == last and first_incarnation and int(step) == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        # A safety net, far above a restart's seconds: without a return the counts say so.
        deadline = time.monotonic() + 120
        while resolver.task_id != last and updates == 10 and time.monotonic() < deadline:
            if strategy.ps_stats()[0]["training"] == 3:
                break
            time.sleep(0.05)  # polls the ps: the verdict does not depend on how long
        x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        step += 1
    if chief:
        print(f"chief done; ps stats {strategy.ps_stats()}", flush=True)
    sys.exit(0)
while int(step) < 30:
    if fault == "lost-worker" and resolver.task_id == last and int(step) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "stopped-worker" and resolver.task_id == last and int(step) == 3:
        os.kill(os.getpid(), signal.SIGSTOP)
    x, y = torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)
    optimizer.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    step += 1
    if fault == "lost-ps" and int(step) == 10:
        manager.save()
        if chief and first_attempt:
            os.kill(strategy.extended.world.pid("ps", 0), signal.SIGKILL)
if chief:
    print(f"chief trained to step {int(step)}; ps stats {strategy.ps_stats()}", flush=True)
