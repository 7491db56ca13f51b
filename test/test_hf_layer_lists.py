"""stack_layers(model) on models with several layer lists (a multimodal
model's vision encoder and language model), each stacked as a scan of its own,
against the same model unconverted; a list that cannot be stacked stays as it
was, with an UnstackedLayersWarning naming it, while the others are stacked;
a list whose loop works between layers, or whose layers differ, is stacked,
and runs those layers one by one, or as runs of alike layers."""
import copy
import re
import warnings

import pytest
import torch
import torch_xla
import transformers
from torch import nn

from support import supports
from test_hf import per_layer_grads, seeded_generate
from tolerances import TRAINING, close
from torch_xla_ext.hf import (StackedLayers, UnstackedLayersWarning, stack_layers,
                              unstack_layers)
from torch_xla_ext.hf.cache_plan import CACHE_REASON
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


def gemma3(vision_layers=2):
    """Gemma3ForConditionalGeneration: a SigLIP vision tower and a Gemma3 language model."""
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(
            **{**VISION, "num_hidden_layers": vision_layers}),
        text_config=transformers.Gemma3TextConfig(**TEXT, head_dim=8,
                                                  layer_types=["full_attention"] * 2),
        mm_tokens_per_image=PATCHES, image_token_index=IMAGE_TOKEN,
        boi_token_index=BEGIN_IMAGE, eoi_token_index=END_IMAGE)
    torch.manual_seed(0)
    return transformers.Gemma3ForConditionalGeneration(config)


def llava():
    """LlavaForConditionalGeneration: a CLIP vision tower and a Llama language
    model, which takes the vision tower's hidden state `vision_feature_layer`
    -2 (its default: the output of the layer before the last)."""
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**VISION, projection_dim=32),
        text_config=transformers.LlamaConfig(**TEXT), image_token_id=IMAGE_TOKEN,
        vision_feature_layer=-2)
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
    # The vision tower's last hidden state.
    "gemma3": gemma3,
    # The hidden state after the vision tower's first layer: from the scan's
    # per-layer outputs, replayed to transformers' hooks.
    "llava": llava,
}


def trained(model, device, **inputs) -> tuple:
    """The loss of one training step of `model` on `device` (its gradients
    left on the host), the While loops in its graph, and the
    LayerByLayerWarnings it gave."""
    model.to(device).train()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = model(**inputs).loss
    loss.backward()
    hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
    torch_xla.sync()
    model.cpu()  # the gradients too: compared on the host, without a graph per slice
    return (loss.cpu(), hlo.count(" while("),
            [str(each.message) for each in caught if each.category is LayerByLayerWarning])


def check_training_matches(reference, model, inputs: dict, device, scans: int) -> None:
    """One training step of the stacked `model` has the loss and gradients of
    the unconverted `reference`, with `scans` more While loops and no list
    run layer by layer."""
    expected, loops_before, _ = trained(reference, device, **inputs)
    actual, loops_after, one_by_one = trained(model, device, **inputs)
    close(actual, expected, TRAINING)
    assert loops_after == loops_before + scans
    assert not one_by_one
    expected_grads, grads = per_layer_grads(reference), per_layer_grads(model)
    for name, grad in grads.items():
        # A layer whose output nothing reads (LLaVA's last vision layer) has no
        # gradient unconverted, and zeros in the stacked one.
        close(grad, expected_grads.get(name, torch.zeros_like(grad)), TRAINING)
    assert expected_grads.keys() <= grads.keys()


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
    check_training_matches(reference, model, dict(input_ids=ids, pixel_values=pixels, labels=ids),
                           device, scans=2)
    assert any(name.startswith(VISION_LAYERS) for name in per_layer_grads(reference))


NO_DROPOUT = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
ENCODER_DECODER = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                       decoder_ffn_dim=64, **NO_DROPOUT)


def bart(**options):
    """BartForConditionalGeneration, whose encoder's and decoder's loops each
    skip layers at random while training if their LayerDrop is above 0."""
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        **{**ENCODER_DECODER, **options}, max_position_embeddings=32))


def whisper():
    """WhisperForConditionalGeneration: a convolution stem, then the encoder
    layers, and decoder layers with cross-attention."""
    torch.manual_seed(0)
    return transformers.WhisperForConditionalGeneration(transformers.WhisperConfig(
        **ENCODER_DECODER, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
        decoder_start_token_id=1, pad_token_id=0, bos_token_id=1, eos_token_id=2))


ENCODER_DECODER_LAYERS = {"bart": ("model.encoder.layers", "model.decoder.layers"),
                          "whisper": ("model.encoder.layers", "model.decoder.layers")}


def audio_features(device) -> torch.Tensor:
    return torch.randn(BATCH, 8, 16, generator=torch.Generator().manual_seed(2)).to(device)


@supports("training", ("bart", "whisper"))
@supports("default cache", "whisper")
@pytest.mark.parametrize("family", ENCODER_DECODER_LAYERS)
def test_encoder_and_decoder_train_as_a_scan_each(device, family):
    reference = {"bart": bart, "whisper": whisper}[family]()
    model = stack_layers(copy.deepcopy(reference))
    for path in ENCODER_DECODER_LAYERS[family]:
        assert type(model.get_submodule(path)) is StackedLayers
    labels = torch.randint(3, VOCAB, (BATCH, TEXT_TOKENS), generator=torch.Generator().manual_seed(1))
    if family == "bart":  # BART's decoder gets no cache while training
        inputs = dict(input_ids=labels.to(device), labels=labels.to(device))
    else:  # Whisper's makes an empty encoder-decoder cache, which the scan fills
        inputs = dict(input_features=audio_features(device), labels=labels.to(device))
    check_training_matches(reference, model, inputs, device, scans=2)


@supports("generate", "bart")
def test_encoder_decoder_generation_matches_the_unconverted_model(device):
    reference = bart()
    model = stack_layers(copy.deepcopy(reference))
    ids = torch.randint(3, VOCAB, (BATCH, TEXT_TOKENS), generator=torch.Generator().manual_seed(1))
    results = []
    for which in (reference, model):
        with warnings.catch_warnings(record=True) as caught, torch.no_grad():
            warnings.simplefilter("always")
            tokens = which.to(device).eval().generate(ids.to(device), do_sample=False,
                                                      max_new_tokens=2, min_new_tokens=2)
        results.append((tokens.cpu().tolist(), [str(each.message) for each in caught
                                                if each.category is LayerByLayerWarning]))
    (expected, _), (tokens, one_by_one) = results
    assert tokens == expected
    # The encoder and the prefill (the empty cache) are scans; the decoding
    # step, with a cache that holds tokens, runs its layers one by one.
    assert len(one_by_one) == 1 and CACHE_REASON in one_by_one[0]


def test_layerdrop_runs_the_layers_one_by_one_while_training_and_as_a_scan_otherwise(device):
    reference = bart(encoder_layerdrop=0.5, decoder_layerdrop=0.5)
    model = stack_layers(copy.deepcopy(reference))
    ids = torch.randint(3, VOCAB, (BATCH, TEXT_TOKENS), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    results = []
    for which in (reference, model):
        # The same layers dropped: the encoder's layer 1 (and none of the
        # decoder's, so that each list runs a layer and warns).
        torch.manual_seed(5)
        results.append(trained(which, device, input_ids=ids, labels=ids))
    (expected, loops, _), (actual, same_loops, one_by_one) = results
    close(actual, expected, TRAINING)
    assert same_loops == loops
    # The dry run saw the forward read a random value between layers.
    assert len(one_by_one) == 2 and all(
        "the forward reads a tensor's value while it loops over the layers" in each
        and "`if dropout_probability < self.layerdrop:" in each
        and "LayerDrop while training skips layers at random" in each for each in one_by_one)
    # Whichever layers a draw skips (every layer; the decoder's layer 0), the
    # layers run one by one, as the loop does.
    for seed in (3, 9):
        torch.manual_seed(seed)
        expected = trained(reference, device, input_ids=ids, labels=ids)[0]
        torch.manual_seed(seed)
        close(trained(model, device, input_ids=ids, labels=ids)[0], expected, TRAINING)
    # In evaluation no layer is dropped: the loops are scans.
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        model.to(device).eval()
        logits = model(input_ids=ids, use_cache=False).logits
        assert torch_xla._XLAC._get_xla_tensors_hlo([logits]).count(" while(") == 2
        close(logits, reference.to(device).eval()(input_ids=ids, use_cache=False).logits,
              TRAINING)


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


# Why `checkpoint_one_layer`'s list cannot be stacked: a scan recomputes every layer or none.
CHECKPOINTED = r"gradient checkpointing is enabled on the layers \[1\] of "


def checkpoint_one_layer(layers: nn.ModuleList) -> None:
    layers[1].gradient_checkpointing = True


def test_a_list_that_cannot_be_stacked_stays_with_a_warning_and_the_others_are_stacked():
    model = llava()
    checkpoint_one_layer(model.get_submodule(VISION_LAYERS))
    with pytest.warns(UnstackedLayersWarning,
                      match=rf"cannot stack the layers at '{VISION_LAYERS}': .*{CHECKPOINTED}"
                            rf".*they stay as they were"):
        stack_layers(model)
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    assert type(model.get_submodule(TEXT_LAYERS)) is StackedLayers

    # Named by its path, the list is refused and the model is unchanged.
    model = llava()
    checkpoint_one_layer(model.get_submodule(VISION_LAYERS))
    with pytest.raises(ValueError, match=CHECKPOINTED):
        stack_layers(model, path=VISION_LAYERS)
    assert type(model.get_submodule(VISION_LAYERS)) is nn.ModuleList
    assert type(model.get_submodule(TEXT_LAYERS)) is nn.ModuleList


def block():
    """A block: a module of two modules that hold tensors."""
    return nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 4))


class TwoLists(nn.Module):
    """A list its forward runs as a loop a scan stands for, and one with work between
    two layers."""

    def __init__(self):
        super().__init__()
        self.first = nn.ModuleList(block() for _ in range(3))
        self.second = nn.ModuleList(block() for _ in range(3))

    def forward(self, x):
        for layer in self.first:
            x = layer(x)
        for layer in self.second:
            x = layer(x)
            x = x * 2
        return x


def test_a_loop_with_work_between_layers_runs_them_one_by_one_and_another_list_scans(device):
    model = TwoLists()
    reference = copy.deepcopy(model).to(device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstackedLayersWarning)
        stack_layers(model)
    assert type(model.first) is StackedLayers and type(model.second) is StackedLayers
    model.to(device)
    x = torch.randn(2, 4, device=device)
    with pytest.warns(LayerByLayerWarning) as caught:
        output = model(x)
    # One warning, for the second list, naming the line that works between its layers.
    (message,) = [str(each.message) for each in caught if each.category is LayerByLayerWarning]
    assert re.search(r"^The 3 layers ran one by one.*works on what layer 0 returned before "
                     r"layer 1 gets it \(.*test_hf_layer_lists\.py:\d+: `x = x \* 2`\)",
                     message), message
    assert torch_xla._XLAC._get_xla_tensors_hlo([output]).count(" while(") == 1
    close(output, reference(x), TRAINING)


class Unlike(nn.Module):
    """A list of three blocks, each built otherwise than its neighbours."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([block(), nn.Sequential(nn.Linear(4, 4), nn.Tanh(),
                                                            nn.Linear(4, 4)), block()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_a_list_with_no_two_neighbours_alike_says_each_layer_runs_as_itself(device):
    model = Unlike()
    reference = copy.deepcopy(model).to(device)
    with pytest.warns(UnstackedLayersWarning) as caught:
        stack_layers(model)
    (message,) = [str(each.message) for each in caught]
    assert message.startswith("stack_layers: the layers at 'layers' are each built otherwise "
                              "than their neighbours (Layer 1 differs from layer 0: it ")
    x = torch.randn(2, 4, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", LayerByLayerWarning)
        close(model.to(device)(x), reference(x), TRAINING)


def test_a_model_whose_every_list_cannot_be_stacked_is_refused():
    model = llava()
    for path in (VISION_LAYERS, TEXT_LAYERS):
        checkpoint_one_layer(model.get_submodule(path))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstackedLayersWarning)
        with pytest.raises(ValueError,
                           match=rf"cannot stack the layers at '{VISION_LAYERS}': .*{CHECKPOINTED}"):
            stack_layers(model)
    for path in (VISION_LAYERS, TEXT_LAYERS):
        assert type(model.get_submodule(path)) is nn.ModuleList


def test_a_list_whose_layers_differ_in_a_setting_runs_as_runs_of_alike_layers(device):
    # The last vision layer's norm differs in a setting: the list keeps one
    # storage (the same structure) and two kinds of layers, which compute
    # differently, so layers 0-1 are one scan and layer 2 runs as itself.
    reference = gemma3(vision_layers=3)
    reference.get_submodule(VISION_LAYERS)[2].layer_norm1.eps = 1e-3
    model = copy.deepcopy(reference)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnstackedLayersWarning)
        stack_layers(model)
    vision = model.get_submodule(VISION_LAYERS)
    assert type(vision) is StackedLayers and len(vision.plan) == 1 and vision.kinds == (0, 0, 1)
    assert vision[2].layer_norm1.eps == 1e-3 and vision[1].layer_norm1.eps != 1e-3
    assert type(model.get_submodule(TEXT_LAYERS)) is StackedLayers
    ids, pixels = image_and_text(device)
    outputs = []
    for which in (reference, model):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("error", LayerByLayerWarning)
            outputs.append(which.to(device).eval()(input_ids=ids, pixel_values=pixels).logits)
    expected, logits = outputs
    unconverted = torch_xla._XLAC._get_xla_tensors_hlo([expected]).count(" while(")
    # A scan of vision layers 0-1 and one of the text layers.
    assert torch_xla._XLAC._get_xla_tensors_hlo([logits]).count(" while(") == unconverted + 2
    close(logits, expected, TRAINING)
