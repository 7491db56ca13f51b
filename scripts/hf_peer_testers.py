"""The model testers of scripts/hf_peer_suite.py: for each family a tiny
config and its inputs (a `ModelTester`, as transformers' own test files give
theirs), and a `unittest.TestCase` mixing in transformers' `ModelTesterMixin`
(from the sdist, scripts/hf_peer_sdist.py) with the family's model classes.

The classes are transformers' own test classes' counterparts, written here:
the base model, the causal LM and the task heads each family has. Sizes are
small enough for the XLA CPU backend to compile each test's graphs quickly:
2 layers (ModelTesterMixin's test_num_layers_is_small allows no more), hidden
size 32, 4 heads of 8 (2 key/value heads), a vocabulary of 99, batches of 3
sequences of 7 tokens.

Importing this module imports test_modeling_common.py from the cache, and so
transformers.testing_utils, whose `torch_device` is read from
TRANSFORMERS_TEST_DEVICE at that import: the suite's worker sets it first.
"""
from __future__ import annotations

import unittest

import torch
import transformers
from transformers.testing_utils import torch_device

import hf_peer_sdist

ModelTesterMixin = hf_peer_sdist.import_tests_module("test_modeling_common").ModelTesterMixin

# A fixed seed for each tester's inputs, so that a test draws the same inputs
# in both modes of the suite.
INPUTS_SEED = 0
# The first tokens of each batch's last sequence are padding (masked), so
# that the tests exercise attention masks.
PADDED_TOKENS = 2


class TinyDecoderTester:
    """The config and inputs of a tiny decoder-only model of `config_class`;
    a family's tester adds its own settings in `family_settings`."""
    config_class: type = None
    batch_size = 3
    seq_length = 7
    is_training = True
    vocab_size = 99
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    intermediate_size = 37
    max_position_embeddings = 64
    num_labels = 3
    pad_token_id = 0

    def __init__(self):
        self.generator = torch.Generator().manual_seed(INPUTS_SEED)

    def family_settings(self) -> dict:
        return {}

    def get_config(self):
        return self.config_class(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            max_position_embeddings=self.max_position_embeddings, num_labels=self.num_labels,
            pad_token_id=self.pad_token_id, bos_token_id=1, eos_token_id=2,
            **self.family_settings())

    def prepare_config_and_inputs_for_common(self):
        shape = (self.batch_size, self.seq_length)
        # Token 0 is padding: the sequences' own tokens are drawn above it.
        input_ids = torch.randint(self.pad_token_id + 1, self.vocab_size, shape,
                                  generator=self.generator)
        attention_mask = torch.ones(shape, dtype=torch.long)
        attention_mask[-1, :PADDED_TOKENS] = 0
        input_ids[-1, :PADDED_TOKENS] = self.pad_token_id
        return self.get_config(), {"input_ids": input_ids.to(torch_device),
                                   "attention_mask": attention_mask.to(torch_device)}


class LlamaTester(TinyDecoderTester):
    config_class = transformers.LlamaConfig


class Qwen3Tester(TinyDecoderTester):
    config_class = transformers.Qwen3Config


class MistralTester(TinyDecoderTester):
    config_class = transformers.MistralConfig

    def family_settings(self) -> dict:
        # Shorter than the sequences, so that the window masks something.
        return {"sliding_window": 4}


class Gemma3TextTester(TinyDecoderTester):
    config_class = transformers.Gemma3TextConfig

    def family_settings(self) -> dict:
        # Both kinds of layer (Gemma 3's pattern is 5 sliding, 1 full; its
        # default for 2 layers would be 2 sliding); queries scaled by the head
        # size, not by Gemma's default of 256.
        return {"layer_types": ["sliding_attention", "full_attention"],
                "query_pre_attn_scalar": self.head_dim, "sliding_window": 4}


class MixtralTester(TinyDecoderTester):
    config_class = transformers.MixtralConfig

    def family_settings(self) -> dict:
        # transformers' default experts implementation, grouped_mm, counts each
        # expert's tokens with torch.histc, which fails on XLA for integers (every
        # test but those that build no model, unconverted); batched_mm runs there,
        # and is the one whose layers stack_layers scans.
        return {"num_local_experts": 4, "num_experts_per_tok": 2,
                "experts_implementation": "batched_mm"}


class PeerTestCase(ModelTesterMixin):
    """What the families' test cases share: their tester made per test."""
    model_tester_class: type = None

    def setUp(self):
        self.model_tester = self.model_tester_class()

    @unittest.skip("GenerationTesterMixin's generate() tests are not in the transformers sdist "
                   "(tests/generation/ is missing), so no test case can inherit them")
    def test_generation_tester_mixin_inheritance(self):
        pass


def model_classes(prefix: str, heads: tuple[str, ...] = (
        "ForCausalLM", "ForSequenceClassification", "ForQuestionAnswering",
        "ForTokenClassification")) -> tuple[type, ...]:
    """transformers' `<prefix>Model` and its classes with `heads`."""
    return tuple(getattr(transformers, prefix + suffix) for suffix in ("Model", *heads))


class LlamaModelTest(PeerTestCase, unittest.TestCase):
    model_tester_class = LlamaTester
    all_model_classes = model_classes("Llama")


class Qwen3ModelTest(PeerTestCase, unittest.TestCase):
    model_tester_class = Qwen3Tester
    all_model_classes = model_classes("Qwen3")


class MistralModelTest(PeerTestCase, unittest.TestCase):
    model_tester_class = MistralTester
    all_model_classes = model_classes("Mistral")


class Gemma3TextModelTest(PeerTestCase, unittest.TestCase):
    model_tester_class = Gemma3TextTester
    all_model_classes = (transformers.Gemma3TextModel, transformers.Gemma3ForCausalLM,
                         transformers.Gemma3TextForSequenceClassification)


class MixtralModelTest(PeerTestCase, unittest.TestCase):
    model_tester_class = MixtralTester
    all_model_classes = model_classes("Mixtral")
