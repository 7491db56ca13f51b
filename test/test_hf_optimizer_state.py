"""Optimizer state dicts across stack_layers: saved by the unconverted model's
optimizer and loaded by the converted model's, and the reverse, against an
uninterrupted run of the unconverted model: the converted model's optimizer
holds the layers' own Parameters, and the state of the stacked steps is
given per layer (torch_xla_ext.layer_stack.stacked_steps)."""
import io
import os
import tempfile
import warnings

import pytest
import torch
import torch_xla  # noqa: F401 (the XLA device)
import transformers
from torch.utils import _pytree as pytree

from test_hf import batch, make_model
from test_hf_layer_kinds import converted_pair as kinds_pair
from test_hf_peft import peft_pair
from tolerances import LOGGED_LOSSES, TRAINING, close
from test_hf_layer_kinds import GEMMA3_GROUPS
from torch_xla_ext.hf import stack_layers

LAYERS, STEPS_BEFORE, STEPS_AFTER = 2, 2, 2


def frozen_embeddings(model):
    """The model with its input embeddings frozen: the Trainer's groups leave them out."""
    model.get_input_embeddings().weight.requires_grad_(False)
    return model


def optimizer_and_scheduler(kind: str, model):
    """As the Trainer makes them: the trainable parameters in model order, in
    a group with weight decay and one of norms without, and a linear schedule."""
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    groups = [{"params": [param for name, param in trainable if "norm" not in name],
               "weight_decay": 0.1},
              {"params": [param for name, param in trainable if "norm" in name],
               "weight_decay": 0.0}]
    if kind == "adamw":
        optimizer = torch.optim.AdamW(groups, lr=1e-2)
    else:
        optimizer = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    total = STEPS_BEFORE + STEPS_AFTER
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.25, total_iters=total)
    return optimizer, scheduler


def train(model, optimizer, scheduler, device, steps: range):
    for step in steps:
        ids, mask = batch(device, seed=step)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        torch_xla.sync()


def saved(*objects):
    """The state dicts of `objects` as a checkpoint file holds them: on the
    CPU, through torch.save and torch.load."""
    states = [pytree.tree_map(lambda value: value.cpu() if isinstance(value, torch.Tensor)
                              else value, each.state_dict()) for each in objects]
    file = io.BytesIO()
    torch.save(states, file)
    file.seek(0)
    return torch.load(file)


def trained(kind, model, device, steps: range, checkpoint=None):
    """`model` (on `device`) trained for `steps`, after loading `checkpoint`
    (model, optimizer and scheduler state dicts) if given; returns the
    model's, optimizer's and scheduler's state dicts, saved."""
    model.to(device).train()
    optimizer, scheduler = optimizer_and_scheduler(kind, model)
    if checkpoint is not None:
        model_state, optimizer_state, scheduler_state = checkpoint
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        scheduler.load_state_dict(scheduler_state)
    train(model, optimizer, scheduler, device, steps)
    return saved(model, optimizer, scheduler)


@pytest.fixture(scope="module")
def uninterrupted_run(device):
    """The run of the unconverted model that each resumed run of an optimizer
    kind is compared with, whichever side saved its checkpoint: trained once
    per kind."""
    runs = {}

    def run(kind):
        if kind not in runs:
            runs[kind] = trained(kind, frozen_embeddings(make_model(layers=LAYERS)), device,
                                 range(STEPS_BEFORE + STEPS_AFTER))
        return runs[kind]

    return run


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("saved_by", ["unconverted", "converted"])
def test_a_checkpoint_resumes_on_the_other_side_as_an_uninterrupted_run(device, kind, saved_by,
                                                                        uninterrupted_run):
    before, after = range(STEPS_BEFORE), range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER)
    uninterrupted = uninterrupted_run(kind)
    saver = frozen_embeddings(make_model(layers=LAYERS))
    if saved_by == "converted":
        stack_layers(saver)
    checkpoint = trained(kind, saver, device, before)
    # Another initialization: every weight and state must come from the checkpoint.
    resumed = frozen_embeddings(make_model(layers=LAYERS, seed=5))
    if saved_by == "unconverted":
        stack_layers(resumed)
    model_state, optimizer_state, scheduler_state = trained(kind, resumed, device, after,
                                                            checkpoint)

    expected_model, expected_optimizer, expected_scheduler = uninterrupted
    assert model_state.keys() == expected_model.keys()
    for name, tensor in model_state.items():
        close(tensor, expected_model[name], TRAINING)
    # The optimizer's state too, in the unconverted layout on either side.
    assert optimizer_state["param_groups"] == expected_optimizer["param_groups"]
    assert optimizer_state["state"].keys() == expected_optimizer["state"].keys()
    for index, state in optimizer_state["state"].items():
        assert state.keys() == expected_optimizer["state"][index].keys()
        for key, value in state.items():
            close(value, expected_optimizer["state"][index][key], TRAINING)
    assert scheduler_state == expected_scheduler


def artificial_state(optimizer):
    """A state for every parameter of `optimizer` that tells them apart, as
    AdamW's (no step needed, no device)."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            optimizer.state[param] = {"step": torch.tensor(3.0), "exp_avg": param.detach() * 2,
                                      "exp_avg_sq": param.detach() ** 2}


def trainable(model) -> list:
    return [(name, param) for name, param in model.named_parameters() if param.requires_grad]


@pytest.mark.parametrize("model_kind", ["llama", "gemma3-groups", "lora"])
def test_named_groups_save_the_unconverted_names_order_and_state(model_kind):
    if model_kind == "llama":
        reference = make_model(layers=3)
        converted = stack_layers(make_model(layers=3))
    elif model_kind == "lora":  # the base weights frozen, left out of the optimizer
        reference, converted = peft_pair(r=4, target_modules=["q_proj", "v_proj"])
    else:
        reference, converted = kinds_pair("gemma3", groups=True)
        assert tuple(converted.model.layers.plan) == GEMMA3_GROUPS  # layer 0, then groups
    unconverted_optimizer = torch.optim.AdamW(trainable(reference))
    artificial_state(unconverted_optimizer)
    converted_optimizer = torch.optim.AdamW(trainable(converted))
    converted_optimizer.load_state_dict(unconverted_optimizer.state_dict())

    assert converted_optimizer.param_groups[0]["param_names"] == [
        name for name, _ in trainable(reference)]
    expected = unconverted_optimizer.state_dict()
    actual = converted_optimizer.state_dict()
    assert actual["param_groups"] == expected["param_groups"]
    assert actual["param_groups"][0]["param_names"] == [name for name, _ in trainable(reference)]
    for index, state in expected["state"].items():
        for key, value in state.items():
            close(actual["state"][index][key], value, TRAINING)


# transformers' Trainer on the XLA device (through accelerate), as test_hf.py
# runs it: a run of 5 steps that writes a checkpoint at step 2 (optimizer.pt,
# scheduler.pt: AdamW with weight decay, a linear schedule), and a run of the
# model on the other side of the conversion that resumes from it with the
# user's unchanged `train(resume_from_checkpoint=...)`; the losses of steps
# 3-5 depend on the optimizer's state (without optimizer.pt they differ by 1e-2).
def trainer_resume_scenario(saved_by: str):
    """A run saved by one side of the conversion resumed by the other (`saved_by`)."""
    from torch_xla_ext.hf import stack_layers
    from torch_xla_ext.layer_stack import LayerByLayerWarning

    def model_for(converted, seed):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False))
        return stack_layers(model) if converted else model

    class StepsRun(transformers.TrainerCallback):
        # The steps this run trained, not those of the checkpoint it resumed.
        def __init__(self):
            self.steps = []

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(state.global_step)

        def losses(self, log_history):
            return {entry["step"]: entry["loss"] for entry in log_history
                    if "loss" in entry and entry["step"] in self.steps}

    ids = torch.randint(0, 128, (8, 8), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    def losses(model, out, resume=None):
        args = transformers.TrainingArguments(
            out, per_device_train_batch_size=2, max_steps=5, logging_steps=1, save_steps=2,
            optim="adamw_torch", learning_rate=1e-2, weight_decay=0.1, lr_scheduler_type="linear",
            report_to=[], seed=3, disable_tqdm=True)
        steps = StepsRun()
        trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset,
                                       callbacks=[steps])
        trainer.train(resume_from_checkpoint=resume)
        assert next(model.parameters()).device.type == "xla"
        return steps.losses(trainer.state.log_history)

    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        expected = losses(model_for(saved_by == "converted", 0), out)
        saved = set(os.listdir(os.path.join(out, "checkpoint-2")))
        assert {"optimizer.pt", "scheduler.pt"} <= saved
        # Another initialization: every weight and state must come from the checkpoint.
        resumed = losses(model_for(saved_by == "unconverted", 7), os.path.join(out, "resumed"),
                         resume=os.path.join(out, "checkpoint-2"))
    assert sorted(resumed) == [3, 4, 5], resumed
    close(torch.tensor([resumed[step] for step in (3, 4, 5)]),
          torch.tensor([expected[step] for step in (3, 4, 5)]), LOGGED_LOSSES)
    print("resumed losses", resumed)


@pytest.mark.parametrize("saved_by", ["unconverted", "converted"])
def test_the_trainer_resumes_a_checkpoint_of_the_other_side_as_an_uninterrupted_run(
        run_isolated, saved_by):
    result = run_isolated(trainer_resume_scenario, args=(saved_by,))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "resumed losses" in result.stdout
