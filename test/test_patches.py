"""Changes to other libraries (torch_xla_ext.patches): made once, however
many threads ask, when the library is imported, and undone by putting back
what was there; stack_layers' changes to peft and transformers undone by the
unstack_layers after which no stacked model remains."""
import sys
import threading
import time

import pytest

from torch_xla_ext.patches.patching import Added, Patch, Replaced


def shouting(method):
    def shout(self):
        return method(self).upper()
    return shout


def library_classes():
    """A class of a library and its base, made afresh for each test."""
    class Base:
        def greet(self):
            return "base"

    class Owner(Base):
        def name(self):
            return "owner"

    return Base, Owner


def test_a_patch_is_made_once_and_undone_to_what_was_there():
    Base, Owner = library_classes()
    own_name, kept = vars(Owner)["name"], {"x"}
    patch = Patch("sys")  # imported: the change is made at once
    patch.install(lambda: [Replaced(Owner, "name", shouting), Replaced(Owner, "greet", shouting),
                           Added(kept, ("x", "y"))])
    assert patch.installed
    assert (Owner().name(), Owner().greet(), Base().greet(), kept) == (
        "OWNER", "BASE", "base", {"x", "y"})
    patch.install(lambda: [Replaced(Owner, "name", shouting)])  # asked again: nothing more
    assert Owner().name() == "OWNER"
    assert patch.undo() and not patch.installed
    # The owner's own method is back, the inherited one inherited again, and
    # only what was added is taken out.
    assert vars(Owner)["name"] is own_name and "greet" not in vars(Owner) and kept == {"x"}
    patch.install(lambda: [Replaced(Owner, "name", shouting)])  # made again after undo
    assert Owner().name() == "OWNER"


def test_a_patch_wrapped_over_since_is_not_undone():
    _, Owner = library_classes()
    patch = Patch("sys")
    patch.install(lambda: [Replaced(Owner, "name", shouting)])
    Owner.name = shouting(Owner.name)  # another library wraps our wrapper
    assert not patch.undo() and patch.installed
    assert Owner().name() == "OWNER"


def test_a_change_that_fails_leaves_the_library_as_it_was():
    _, Owner = library_classes()
    own_name = vars(Owner)["name"]
    patch = Patch("sys")
    with pytest.raises(AttributeError, match="missing"):
        patch.install(lambda: [Replaced(Owner, "name", shouting),
                               Replaced(Owner, "missing", shouting)])
    assert vars(Owner)["name"] is own_name and not patch.installed
    patch.install(lambda: [Replaced(Owner, "name", shouting)])  # may be tried again
    assert Owner().name() == "OWNER"


def test_threads_racing_to_install_make_the_change_once_before_any_returns():
    _, Owner = library_classes()
    patch, wrapped, names = Patch("sys"), [], []

    def slowly_shouting(method):
        wrapped.append(method)
        time.sleep(0.05)  # without the lock, every thread would wrap meanwhile
        return shouting(method)

    start = threading.Barrier(8)

    def install():
        start.wait()
        patch.install(lambda: [Replaced(Owner, "name", slowly_shouting)])
        names.append(Owner().name())  # made by the time install returns

    threads = [threading.Thread(target=install) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(wrapped) == 1 and names == ["OWNER"] * 8


def test_a_patch_waits_for_its_library_without_importing_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("late_library", "undone_library"):
        (tmp_path / f"{name}.py").write_text(
            "class Late:\n    def name(self):\n        return 'late'\n")
        monkeypatch.delitem(sys.modules, name, raising=False)

    def changes(name):
        return lambda: [Replaced(sys.modules[name].Late, "name", shouting)]

    late = Patch("late_library")
    late.install(changes("late_library"))
    late.install(changes("late_library"))  # asked twice while waiting: made once
    assert "late_library" not in sys.modules and not late.installed
    import late_library
    assert late.installed and late_library.Late().name() == "LATE"

    undone = Patch("undone_library")
    undone.install(changes("undone_library"))
    assert undone.undo()  # while it waits: the import changes nothing
    import undone_library
    assert not undone.installed and undone_library.Late().name() == "late"


UNDONE_WITH_THE_LAST_STACK = """
import copy
import torch, transformers
import transformers.trainer_pt_utils as trainer_utils
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTuner
from transformers.models.llama.modeling_llama import LlamaDecoderLayer
import torch_xla_ext as tx

def library():
    return (vars(BaseTuner)["inject_adapter"], vars(BaseTuner)["merge_and_unload"])

def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2))

untouched = library()
model = tx.stack_layers(llama())
changed = library()
assert all(now is not before for now, before in zip(changed, untouched)), "not changed"
# transformers' FSDP wrapping finds the layers' class, which stay in the module tree.
assert trainer_utils.get_module_class_from_name(model, "LlamaDecoderLayer") is LlamaDecoderLayer
copied = copy.deepcopy(model)
# peft unstacks and stacks the layers again around adding an adapter: the changes stay.
adapted = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj"]))
assert type(adapted.base_model.model.model.layers).__name__ == "StackedLayers"
assert library() == changed, "peft's own unstacking undid the changes"
tx.unstack_layers(adapted)
assert library() == changed, "undone while a copy of a stacked model stands"
tx.unstack_layers(copied)
assert library() == untouched, "not undone when no stacked model remains"
assert trainer_utils.get_module_class_from_name(copied, "LlamaDecoderLayer") is LlamaDecoderLayer
again = tx.stack_layers(llama())
assert all(now is not before for now, before in zip(library(), untouched)), "not made again"
print("undone")
"""


def test_unstack_layers_undoes_the_changes_to_peft_with_the_last_stack(
        run_isolated):
    result = run_isolated(UNDONE_WITH_THE_LAST_STACK)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "undone" in result.stdout
