"""What one cached training step of a converted model does in our code: a
kind of call planned once runs by its plan, so the step (forward, backward,
sync) enters few of the package's modules, and reads no layer's settings
(test_hf_layers_in_tree: no layout read)."""
import os
import sys

import torch
import torch_xla

import torch_xla_ext as tx
from test_hf import batch, make_model

PACKAGE = os.path.dirname(tx.__file__) + os.sep

# The files a cached step of the model below enters today; issue 50's goal is 15.
MOST_FILES = 27


def files_entered(run) -> set[str]:
    """The package's source files whose code `run()` calls, on any thread it
    runs on (the backward runs on the caller's, with autograd's threads off)."""
    entered = set()

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            entered.add(frame.f_code.co_filename[len(PACKAGE):])
    with torch.autograd.set_multithreading_enabled(False):
        sys.setprofile(profile)
        try:
            run()
        finally:
            sys.setprofile(None)
    return entered


def test_a_cached_training_step_enters_few_of_the_package_files(device):
    model = tx.stack_layers(make_model(layers=4)).to(device)
    ids, mask = batch(device)

    def step():
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        torch_xla.sync()
    for _ in range(2):  # planned, then traced and compiled
        step()
    entered = files_entered(step)
    assert "layer_stack/storage.py" in entered and "scan/autograd.py" in entered  # it saw them
    assert len(entered) <= MOST_FILES, sorted(entered)
    for planning in ("layer_stack/dry_run.py", "layer_stack/planner.py", "layer_stack/alike.py",
                     "layer_stack/forms.py", "scan/tracing.py", "layer_stack/per_layer.py"):
        assert planning not in entered, planning
