"""transformers' gradient checkpointing on a converted model: the stacked
layers' scan recomputes each layer (policy save_nothing), against the
unconverted model checkpointing its layers with torch_xla's checkpoint
(torch.utils.checkpoint's non-reentrant one does not run on XLA)."""
import copy
import functools
import tempfile
import warnings

import pytest
import torch
import torch_xla
import torch_xla.utils.checkpoint as xla_checkpoint
from torch import nn

import torch_xla_ext as tx
from support import supports
from reference import host_copies
from test_hf import batch, make_model, per_layer_grads
from test_hf_layer_kinds import converted_pair as kinds_pair
from tolerances import LOGGED_LOSSES, TRAINING, close, close_by_name
from torch_xla_ext import policies
from torch_xla_ext.hf import StackedLayers, stack_layers, unstack_layers
from torch_xla_ext.hf.checkpointing import CheckpointingWarning
from torch_xla_ext.layer_stack import LayerByLayerWarning, executors


@pytest.fixture
def policies_run(monkeypatch) -> list:
    """The partition_fn of every scan the stacks run, in order."""
    seen = []

    def recording_scan(*args, **kwargs):
        seen.append(kwargs["partition_fn"])
        return scan(*args, **kwargs)

    scan = executors.scan
    monkeypatch.setattr(executors, "scan", recording_scan)
    return seen


def checkpointed_with_torch_xla(model):
    """`model` with its layers checkpointed as gradient_checkpointing_enable()
    does, with torch_xla's checkpoint function in place of torch's."""
    model._set_gradient_checkpointing(
        enable=True,
        gradient_checkpointing_func=functools.partial(xla_checkpoint.checkpoint,
                                                      use_reentrant=True))
    return model


def training_step(model, device, grads_of=per_layer_grads) -> dict:
    """The loss and every gradient (by unconverted name) of one training step, on the host."""
    ids, mask = batch(device)
    model.to(device).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        warnings.simplefilter("error", CheckpointingWarning)
        loss = model(ids, attention_mask=mask, labels=ids).loss
    loss.backward()
    grads = grads_of(model)
    return dict(zip(["loss", *grads], host_copies([loss, *grads.values()])))


def assert_same_step(actual: dict, expected: dict) -> None:
    close_by_name(actual, expected, TRAINING)


@pytest.fixture(scope="module")
def checkpointed_llama_step(device) -> dict:
    """The training step of the unconverted 3-layer Llama, checkpointed by
    torch_xla's function, that each way of enabling checkpointing on the
    converted one is compared with: run once."""
    return training_step(checkpointed_with_torch_xla(make_model(layers=3)), device)


@supports("gradient checkpointing", "llama")
@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": True},
                                    {"use_reentrant": False, "preserve_rng_state": False}],
                         ids=["no-kwargs", "reentrant", "non-reentrant"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_enabled_before_or_after_stacking_the_scan_recomputes_with_the_unconverted_gradients(
        device, policies_run, when, kwargs, checkpointed_llama_step):
    model = make_model(layers=3)
    if when == "before":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    stack_layers(model)
    if when == "after":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    assert type(model.model.layers) is StackedLayers and model.is_gradient_checkpointing
    expected = checkpointed_llama_step
    traces_before = tx.cache_info().misses
    actual = training_step(model, device)
    # One scan, traced once, under the recomputing policy.
    assert policies_run == [policies.save_nothing]
    assert tx.cache_info().misses - traces_before == 1
    assert_same_step(actual, expected)


def test_with_the_default_cache_the_scan_recomputes_with_the_unconverted_gradients(
        device, policies_run):
    # use_cache=True, most configs' default: the scan fills the model's DynamicCache
    # (the unconverted layers, checkpointed, leave it empty).
    reference = make_model(layers=2, use_cache=True)
    model = stack_layers(copy.deepcopy(reference))
    model.gradient_checkpointing_enable()
    expected = training_step(checkpointed_with_torch_xla(reference), device)
    assert_same_step(training_step(model, device), expected)
    assert policies_run == [policies.save_nothing]


@supports("gradient checkpointing", ("gemma2", "gemma3"))
@pytest.mark.parametrize("family, groups", [("gemma2", False), ("gemma3", True)],
                         ids=["gemma2-one-scan", "gemma3-groups"])
def test_layers_of_several_kinds_recompute_in_every_scan(device, policies_run, family, groups):
    reference, model = kinds_pair(family, groups)
    model.gradient_checkpointing_enable()
    expected = training_step(checkpointed_with_torch_xla(reference), device)
    assert_same_step(training_step(model, device), expected)
    # Layers that run as themselves (Gemma3's layer 0) keep transformers' checkpointing.
    scans = sum(not segment.single for segment in model.model.layers.plan)
    assert policies_run == [policies.save_nothing] * scans


@pytest.mark.parametrize("given", [None, "save_dots"], ids=["default", "users-policy"])
def test_disabling_restores_the_policy_in_force_before(device, policies_run, given):
    options = {} if given is None else {"partition_fn": given}
    before = policies.resolve(given or "save_everything")
    model = stack_layers(make_model(layers=2), **options)
    ids, mask = batch(device)
    model.to(device).train()

    def step():
        model.zero_grad(set_to_none=True)
        model(ids, attention_mask=mask, labels=ids).loss.backward()
        torch_xla.sync()

    traces_before = tx.cache_info().misses
    step()
    model.gradient_checkpointing_enable()
    step()
    model.eval()  # as the unconverted layers, which checkpoint only while training
    with torch.no_grad():
        model(ids, attention_mask=mask)
    model.train()
    model.gradient_checkpointing_disable()
    step()
    assert policies_run == [before, policies.save_nothing, before, before]
    assert not model.is_gradient_checkpointing
    # The policy is part of what is traced: one trace each (and one without gradients).
    assert tx.cache_info().misses - traces_before == 3


def test_kwargs_and_checkpoint_functions_the_scan_cannot_honour_are_named_in_a_warning(
        device, policies_run):
    reference = make_model(layers=2)
    expected = training_step(checkpointed_with_torch_xla(copy.deepcopy(reference)), device)
    for enable, named in [
            (dict(gradient_checkpointing_kwargs={"use_reentrant": False, "debug": True,
                                                 "unknown_option": 3}),
             r"debug=True, unknown_option=3 among gradient_checkpointing_kwargs"),
            (dict(offload=True), r"cannot call the checkpoint function '.*checkpoint_func'")]:
        model = stack_layers(copy.deepcopy(reference))
        model.gradient_checkpointing_enable(**enable)
        model.to(device).train()
        ids, mask = batch(device)
        with pytest.warns(CheckpointingWarning, match=named):
            loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        grads = per_layer_grads(model)
        actual = dict(zip(["loss", *grads], host_copies([loss, *grads.values()])))
        assert_same_step(actual, expected)
    assert policies_run == [policies.save_nothing] * 2


def test_checkpointing_on_some_layers_only_is_refused_and_the_model_is_unchanged():
    model = make_model(layers=3)
    model.activation_checkpointing_enable(every_n_layers=2)
    with pytest.raises(ValueError, match=r"enabled on the layers \[0, 2\] of 'model\.layers' "
                                         r"only, of 3 .*every_n_layers"):
        stack_layers(model)
    assert type(model.model.layers) is nn.ModuleList
    assert [layer.gradient_checkpointing for layer in model.model.layers] == [True, False, True]


def same_function(actual, expected) -> bool:
    """Checkpoint functions alike (the stack's is a copy of the layers')."""
    return (actual.func, actual.args, actual.keywords) == (expected.func, expected.args,
                                                           expected.keywords)


def test_the_layers_carry_the_stacks_checkpointing_as_transformers_sets_it():
    model = make_model(layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    function = model.model.layers[0]._gradient_checkpointing_func
    stack_layers(model)
    stack = model.model.layers
    assert stack.gradient_checkpointing
    assert same_function(stack._gradient_checkpointing_func, function)
    # Each layer, as the model's modules would have it; and back to layers, and stacked again.
    assert all(layer.gradient_checkpointing
               and same_function(layer._gradient_checkpointing_func, function) for layer in stack)
    unstack_layers(model)
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    stack_layers(model)
    assert model.model.layers.gradient_checkpointing
    model.gradient_checkpointing_disable()
    assert not any(layer.gradient_checkpointing for layer in model.model.layers)


# transformers' Trainer with gradient_checkpointing=True, as in test_hf.py's
# trainer_run_scenario; the unconverted model checkpoints with torch_xla's function.
def trainer_run_scenario():
    """transformers' Trainer with gradient_checkpointing=True trains the converted model
    (each scan recomputing) and the unconverted one to the same logged losses."""
    import transformers.modeling_utils
    from torch_xla_ext.layer_stack import LayerByLayerWarning, executors

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False))
    converted = stack_layers(copy.deepcopy(model))
    ids = torch.randint(0, 128, (4, 8), generator=torch.Generator().manual_seed(1))
    dataset = [{"input_ids": row, "labels": row} for row in ids]

    seen = []
    scan = executors.scan
    executors.scan = (lambda *args, **kwargs:
                    seen.append(kwargs["partition_fn"]) or scan(*args, **kwargs))

    def logged_losses(model, **options):
        with tempfile.TemporaryDirectory() as out:
            args = transformers.TrainingArguments(
                out, per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                optim="adamw_torch", learning_rate=1e-2, report_to=[], save_strategy="no", seed=3,
                disable_tqdm=True, gradient_checkpointing=True, **options)
            trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset)
            trainer.train()
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]

    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        warnings.simplefilter("error", CheckpointingWarning)
        losses = logged_losses(converted)
    assert converted.model.layers.gradient_checkpointing and converted.is_gradient_checkpointing
    assert seen == [policies.save_nothing] * 2, seen
    # torch's non-reentrant checkpoint, transformers' default, does not run on XLA.
    transformers.modeling_utils.checkpoint = xla_checkpoint.checkpoint
    expected = logged_losses(model, gradient_checkpointing_kwargs={"use_reentrant": True})
    assert model.model.layers[0].gradient_checkpointing
    assert len(expected) == 2, expected
    close(torch.tensor(losses), torch.tensor(expected), LOGGED_LOSSES)
    print("losses", losses, expected)


def test_a_trainer_with_gradient_checkpointing_recomputes_with_the_unconverted_losses(
        run_isolated):
    result = run_isolated(trainer_run_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "losses" in result.stdout
