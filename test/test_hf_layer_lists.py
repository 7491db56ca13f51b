"""stack_layers(model) on models with several layer lists (a multimodal
model's vision encoder and language model), each stacked as a scan of its own,
against the same model unconverted; a list that cannot be stacked stays as it
was, with an UnstackedLayersWarning naming it, while the others are stacked."""
import copy
import warnings

import pytest
import torch
import torch_xla
import transformers
from torch import nn

from support import supports
from test_hf import device, per_layer_grads, seeded_generate  # noqa: F401 (a fixture)
from tolerances import TRAINING, close
from torch_xla_ext.hf import (StackedLayers, UnstackedLayersWarning, stack_layers,
                              unstack_layers)
from torch_xla_ext.layer_stack import LayerByLayerWarning

VOCAB, TEXT_TOKENS, BATCH = 128, 6, 2
IMAGE_TOKEN, BEGIN_IMAGE, END_IMAGE = 127, 125, 126
# 32x32 images in 16x16 patches: 4 patches, and 4 image tokens in the prompt.
PATCHES = 4
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              image_size=32, patch_size=16)
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)
VISION_LAYERS, TEXT_LAYERS = "model.vision_tower.encoder.layers", "model.language_model.layers"


def gemma3():
    """Gemma3ForConditionalGeneration: a SigLIP vision tower and a Gemma3 language model."""
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(**VISION),
        text_config=transformers.Gemma3TextConfig(**TEXT, head_dim=8,
                                                  layer_types=["full_attention"] * 2),
        mm_tokens_per_image=PATCHES, image_token_index=IMAGE_TOKEN,
        boi_token_index=BEGIN_IMAGE, eoi_token_index=END_IMAGE)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config)


def llava(vision_feature_layer=-2):
    """LlavaForConditionalGeneration: a CLIP vision tower and a Llama language
    model, which takes the vision tower's hidden state `vision_feature_layer`
    (-2 by default: the output of the layer before the last)."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION, projection_dim=32),
        text_config=transformers.LlamaConfig(**TEXT), image_token_id=IMAGE_TOKEN,
        vision_feature_layer=vision_feature_layer)
    torch.manual_seed(0)
    return transformers.LlavaForConditionalGeneration(config)


def image_and_text(device, seed=1):
    generator = torch.Generator().manual_seed(seed)
    text = torch.randint(1, BEGIN_IMAGE, (BATCH, TEXT_TOKENS), generator=generator)
    ids = torch.cat([torch.full((BATCH, PATCHES), IMAGE_TOKEN), text], dim=1)
    pixels = torch.randn(BATCH, 3, 32, 32, generator=generator)
    return ids.to(device), pixels.to(device)


# Each trains with a scan of each list (two loops beyond the unconverted model's).
MULTIMODAL = {
    "gemma3": gemma3,
    # The vision tower's last hidden state.
    "llava-last-layer": lambda: llava(vision_feature_layer=-1),
    # The hidden state after the vision tower's first layer: from the scan's
    # per-layer outputs, replayed to transformers' hooks.
    "llava": llava,
}


@supports("training", ("gemma3", "llava"))
@pytest.mark.parametrize("family", MULTIMODAL)
def test_image_and_text_training_matches_the_unconverted_model(device, family):
    reference = MULTIMODAL[family]()
    model = stack_layers(copy.deepcopy(reference))
    for path in (VISION_LAYERS, TEXT_LAYERS):
        stack = model.get_submodule(path)
        assert type(stack) is StackedLayers and len(stack) == 2
    # Per-layer names, as before the conversion.
    assert model.state_dict().keys() == reference.state_dict().keys()

    ids, pixels = image_and_text(device)
    results = []
    for which in (reference, model):
        which.to(device).train()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = which(input_ids=ids, pixel_values=pixels, labels=ids).loss
        loss.backward()
        hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
        torch_xla.sync()
        which.cpu()  # the gradients too: compared on the host, without a graph per slice
        results.append((loss.cpu(), hlo.count(" while("),
                        [str(each.message) for each in caught
                         if each.category is LayerByLayerWarning]))
    (expected, loops_before, _), (actual, loops_after, one_by_one) = results
    close(actual, expected, TRAINING)
    assert loops_after == loops_before + 2
    assert not one_by_one
    expected_grads, grads = per_layer_grads(reference), per_layer_grads(model)
    assert any(name.startswith(VISION_LAYERS) for name in expected_grads)
    for name, grad in grads.items():
        # A layer whose output nothing reads (LLaVA's last vision layer) has no
        # gradient unconverted, and zeros in the stacked one.
        close(grad, expected_grads.get(name, torch.zeros_like(grad)), TRAINING)
    assert expected_grads.keys() <= grads.keys()


@supports("generate", ("gemma3", "llava"))
@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_text_only_generation_of_a_stacked_multimodal_model(device, family):
    reference = MULTIMODAL[family]()
    model = stack_layers(copy.deepcopy(reference))
    ids = torch.randint(1, BEGIN_IMAGE, (BATCH, TEXT_TOKENS),
                        generator=torch.Generator().manual_seed(2)).to(device)
    mask = torch.ones_like(ids)
    expected = seeded_generate(reference, ids, mask, do_sample=False)
    with warnings.catch_warnings():
        # The prefill and the decoding step are scans (the window holds every token).
        warnings.simplefilter("error", LayerByLayerWarning)
        assert seeded_generate(model, ids, mask, do_sample=False) == expected


def test_unstack_layers_undoes_every_list(device):
    reference = gemma3()
    model = unstack_layers(stack_layers(copy.deepcopy(reference)))
    for path in (VISION_LAYERS, TEXT_LAYERS):
        assert type(model.get_submodule(path)) is nn.ModuleList
    expected = reference.state_dict()
    assert all(torch.equal(value, expected[name]) for name, value in model.state_dict().items())
    # One list by its path.
    stack_layers(model)
    unstack_layers(model, path=VISION_LAYERS)
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    assert type(model.get_submodule(TEXT_LAYERS)) is StackedLayers


def test_a_path_stacks_that_list_only():
    model = stack_layers(gemma3(), path=TEXT_LAYERS)
    assert type(model.get_submodule(TEXT_LAYERS)) is StackedLayers
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    # Without a path afterwards, the list left is stacked too.
    stack_layers(model)
    assert type(model.get_submodule(VISION_LAYERS)) is StackedLayers


def test_a_list_that_cannot_be_stacked_stays_with_a_warning_and_the_others_are_stacked():
    model = llava()
    model.get_submodule(VISION_LAYERS)[1].mlp.register_forward_hook(lambda *args: None)
    with pytest.warns(UnstackedLayersWarning,
                      match=rf"cannot stack the layers at '{VISION_LAYERS}': "
                            rf"{VISION_LAYERS}\.1\.mlp has a hook .*they stay as they were"):
        stack_layers(model)
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    assert type(model.get_submodule(TEXT_LAYERS)) is StackedLayers

    # Named by its path, the list is refused and the model is unchanged.
    model = llava()
    model.get_submodule(VISION_LAYERS)[1].mlp.register_forward_hook(lambda *args: None)
    with pytest.raises(ValueError, match=rf"{VISION_LAYERS}\.1\.mlp has a hook"):
        stack_layers(model, path=VISION_LAYERS)
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    assert type(model.get_submodule(TEXT_LAYERS)) is nn.ModuleList


class TwoLists(nn.Module):
    """A list its forward runs as a loop a scan stands for, and one with work between
    two layers."""
    _no_split_modules = ["Linear"]

    def __init__(self):
        super().__init__()
        self.first = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.second = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    def forward(self, x):
        for layer in self.first:
            x = layer(x)
        for layer in self.second:
            x = layer(x)
            x = x * 2
        return x


def test_a_loop_with_work_between_layers_leaves_its_list_as_it_was(device):
    model = TwoLists()
    reference = copy.deepcopy(model).to(device)
    with pytest.warns(UnstackedLayersWarning, match=r"cannot stack the layers at 'second': "
                                                    r"TwoLists\.forward does more between two "
                                                    r"layers .*`x = x \* 2`"):
        stack_layers(model)
    assert type(model.first) is StackedLayers and type(model.second) is nn.ModuleList
    model.to(device)
    x = torch.randn(2, 4, device=device)
    assert " while(" in torch_xla._XLAC._get_xla_tensors_hlo([model(x)])
    close(model(x), reference(x), TRAINING)


def test_a_model_whose_every_list_cannot_be_stacked_is_refused():
    # BART's encoder and decoder loops drop layers at random (LayerDrop) between two layers.
    config = transformers.BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=2,
                                     decoder_layers=2, encoder_attention_heads=4,
                                     decoder_attention_heads=4, encoder_ffn_dim=64,
                                     decoder_ffn_dim=64, max_position_embeddings=32)
    model = transformers.BartForConditionalGeneration(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstackedLayersWarning)
        with pytest.raises(ValueError, match=r"cannot stack the layers at 'model\.encoder\.layers"
                                             r"': BartEncoder\.forward does more between two "
                                             r"layers"):
            stack_layers(model)
    assert type(model.model.encoder.layers) is nn.ModuleList
    assert type(model.model.decoder.layers) is nn.ModuleList


def test_a_list_whose_layers_are_not_alike_is_refused_and_the_model_is_unchanged():
    model = gemma3()
    model.get_submodule(VISION_LAYERS)[1].layer_norm1.eps = 1e-3
    with pytest.raises(ValueError, match=rf"cannot stack the layers at '{VISION_LAYERS}': "
                                         rf"[Ll]ayer 1 setting 'layer_norm1\.eps'"):
        stack_layers(model)
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    assert type(model.get_submodule(TEXT_LAYERS)) is nn.ModuleList
