"""torch.export of models converted by stack_layers, as torch_xla's export
flow does it (export on the CPU, then `exported_program_to_stablehlo`): one
node of torch's scan operator per run of layers, not a copy of the layer per
layer; one `stablehlo.while` per run once lowered with `register_torch_scan`;
the exported program and its StableHLO give the unconverted model's logits,
and the exported program, run on XLA, its gradients. A key/value cache
written in place is the carry of its scan; what torch's operator cannot take
runs one by one, saying so."""
import copy
import warnings

import pytest
import torch
import torch_xla
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from torch_xla.stablehlo import exported_program_to_stablehlo

import torch_xla_ext as tx
from per_layer import per_layer_grads
from test_hf import VOCAB, make_diffllama, make_model
from test_hf_layer_kinds import COMMON, FAMILIES as KIND_FAMILIES, \
    another_activation_on_full_attention
from tolerances import TRAINING, close, on_host
from torch_xla_ext.hf import stack_layers
from torch_xla_ext.layer_stack import LayerByLayerWarning
from torch_xla_ext.layer_stack import ExportWarning

SCAN = torch.ops.higher_order.scan


def ids_batch(seed=1, batch=2, seq=8):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def lora(model):
    """A LoRA model whose adapters compute something (peft starts lora_B at zero)."""
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1, generator=torch.Generator().manual_seed(0))
    return model


def llama_with_another_layer_3(layers=6):
    """Layers 0-2 and 4-5 alike, layer 3 with another activation module: two runs."""
    model = make_model(layers=layers)
    model.model.layers[3].mlp.act_fn = nn.GELU()
    return model


MODELS = {
    "llama": (lambda: make_model(layers=4), 1),
    "qwen3": (lambda: make_model("qwen3", layers=3), 1),
    # Sliding and full attention layers, whose kinds compute the same program: one run.
    "gemma3": (lambda: torch.manual_seed(0) and KIND_FAMILIES["gemma3"](**COMMON), 1),
    # Kinds that differ in structure: layer 0 as itself, one run over groups.
    "gemma3-groups": (lambda: another_activation_on_full_attention(
        torch.manual_seed(0) and KIND_FAMILIES["gemma3"](**COMMON)), 1),
    "two-runs": (llama_with_another_layer_3, 2),
    "lora": (lambda: lora(make_model(layers=3)), 1),
    # Layers that differ in a number of their arithmetic: one run taking it per layer.
    "diffllama": (make_diffllama, 1),
}


def exported_pair(name):
    """The unconverted model, its converted copy's exported program (eval,
    on the CPU) and the LayerByLayerWarnings of the export."""
    make, _ = MODELS[name]
    reference = make().eval()
    model = stack_layers(copy.deepcopy(reference))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = torch.export.export(model, (ids_batch(),))
    return reference, exported, [str(each.message) for each in caught
                                 if each.category is LayerByLayerWarning]


def scan_nodes(exported) -> int:
    return [node.target for node in exported.graph.nodes].count(SCAN)


@pytest.mark.parametrize("name", list(MODELS))
def test_an_exported_converted_model_is_a_scan_per_run_and_lowers_to_a_while_per_run(name):
    reference, exported, warned = exported_pair(name)
    runs = MODELS[name][1]
    assert scan_nodes(exported) == runs and not warned, warned
    ids = ids_batch()
    expected = reference(ids).logits
    close(exported.module()(ids).logits, expected, TRAINING)
    with tx.register_torch_scan():
        lowered = exported_program_to_stablehlo(exported)
    assert lowered.get_stablehlo_text().count("stablehlo.while") == runs
    close(lowered(ids).logits.cpu(), expected, TRAINING)


def test_an_exported_model_does_not_copy_its_layer_per_layer():
    # The graph's computation does not grow with the layers: one scan node
    # holds one layer, run on each weight's stack of the layers' parameters
    # (the graph's inputs, one per parameter as unconverted).
    sizes = {}
    for layers in (2, 8):
        exported = torch.export.export(stack_layers(make_model(layers=layers)).eval(),
                                       (ids_batch(),))
        sizes[layers] = len([node for node in exported.graph.nodes if node.op != "placeholder"])
        assert scan_nodes(exported) == 1
        assert len(exported.graph_signature.parameters) == len(list(
            make_model(layers=layers).parameters()))
    assert sizes[2] == sizes[8], sizes


class Loss(nn.Module):
    """A causal LM's training loss, as a module to export."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, labels=ids).loss


def test_an_exported_training_loss_run_on_xla_has_the_unconverted_gradients():
    # Exported on XLA (torch's move_to_device_pass leaves some ops of an
    # exported transformers model asserting the CPU, converted or not), run as
    # a module: the scan node runs as one loop each way while registered.
    device = torch_xla.device()
    reference = make_model(layers=2)
    model = stack_layers(copy.deepcopy(reference)).to(device)
    ids = ids_batch().to(device)
    model(ids, labels=ids)  # planned on XLA first: the export's call is a kind of its own
    exported = torch.export.export(Loss(model).train(), (ids,))
    assert scan_nodes(exported) == 1
    assert not [name for name in exported.constants if "lifted" in name], exported.constants
    program = exported.module()
    with tx.register_torch_scan():
        loss = program(ids)
        loss.backward()
    reference.to(device)
    expected = reference(ids, labels=ids).loss
    expected.backward()
    # On the CPU, from one execution: read one by one, each value (a slice of
    # a gradient above all) would compile a graph of its own.
    loss, expected, got, grads = on_host(
        loss, expected, {name: param.grad for name, param in program.named_parameters()},
        per_layer_grads(reference))
    close(loss, expected, TRAINING)
    assert len(grads) == 1 + 9 * 2 + 2  # embeddings, 9 per layer, the final norm, the head
    for name, grad in grads.items():  # the program's parameters are the layers' own
        close(got[f"model.{name}"], grad, TRAINING)


class PrefillAndDecode(nn.Module):
    """A prompt, then one token more, through a StaticCache made in the forward."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        cache = transformers.StaticCache(config=self.model.config, max_cache_len=16)
        first = self.model(ids, past_key_values=cache, use_cache=True).logits
        following = first[:, -1:].argmax(-1)
        return self.model(following, past_key_values=cache, use_cache=True).logits


@pytest.mark.parametrize("gradients", [False, True], ids=["no_grad", "grad"])
def test_a_cache_written_in_place_exports_as_a_scan_whose_carry_it_is(gradients):
    # The decode writes the cache's stacked buffers in place: inside the
    # operator's body, a copy of the carried buffers is written and returned.
    # With gradients, the cache plan runs the decode one by one, saying so.
    reference = make_model(layers=3, use_cache=True).eval()
    model = stack_layers(copy.deepcopy(reference))
    ids = ids_batch()
    with torch.set_grad_enabled(gradients), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        exported = torch.export.export(PrefillAndDecode(model), (ids,))
    warned = [str(each.message) for each in caught if each.category is LayerByLayerWarning]
    assert scan_nodes(exported) == (1 if gradients else 2)
    assert len(warned) == gradients and all("StaticCache" in each for each in warned), warned
    with torch.no_grad():
        expected = PrefillAndDecode(reference)(ids)
        close(exported.module()(ids), expected, TRAINING)
    if not gradients:
        with tx.register_torch_scan():
            lowered = exported_program_to_stablehlo(exported)
        assert lowered.get_stablehlo_text().count("stablehlo.while") == 2
        close(lowered(ids).cpu(), expected, TRAINING)


def test_a_policy_the_exported_program_cannot_hold_is_warned_of():
    model = stack_layers(make_model(layers=2), partition_fn="save_nothing").eval()
    with pytest.warns(ExportWarning, match="partition_fn=save_nothing .*register_torch_scan"):
        exported = torch.export.export(model, (ids_batch(),))
    assert scan_nodes(exported) == 1
