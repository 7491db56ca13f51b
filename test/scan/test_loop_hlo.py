"""XLA's optimized HLO of a LayerStack training step, for each kind of layer:
no copy of a whole stacked buffer ([L, ...]: sliced inputs, stacked outputs)
inside a while body, where it would run once per step of the scan, nor of a
stacked output's initial buffer before the loops."""
import glob

import pytest

from optimized_hlo import dump_flags, copies_of_initial_buffers, stacked_copies_in_loops, while_loops

LAYERS = 3  # a size no other dimension of the step below has

# Forward, loss, backward and an SGD update (which writes the weights in place,
# as the benchmark's step does), compiled as one graph.
def training_step_scenario(block: str):
    import torch
    import torch_xla
    from torch_xla_ext.workloads import make_batch, make_decoder_stack, training_step

    device = torch_xla.device()
    model = make_decoder_stack(LAYERS, hidden=32, heads=2, mode="scan", device=device,
                               block=block)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = make_batch(2, 8, 32, device=device)
    torch_xla.sync()
    training_step(model, batch, optimizer)
    torch_xla.sync()

# A loop over 3 steps whose step writes slice i of a [3,4] stacked output
# through a fusion that copies the whole buffer first.
LOOP_WITH_A_STACKED_COPY = """HloModule example

%fused_update (param_0: f32[3,4], param_1: f32[4], param_2: s64[]) -> f32[3,4] {
  %param_0 = f32[3,4]{1,0} parameter(0)
  %copy.1 = f32[3,4]{1,0} copy(%param_0)
  %param_1 = f32[4]{0} parameter(1)
  %bitcast = f32[1,4]{1,0} bitcast(%param_1)
  %param_2 = s64[] parameter(2)
  %zero = s64[] constant(0)
  ROOT %dynamic-update-slice = f32[3,4]{1,0} dynamic-update-slice(%copy.1, %bitcast, %param_2, %zero)
}

%body (state: (s64[], f32[4], f32[3,4])) -> (s64[], f32[4], f32[3,4]) {
  %state = (s64[], f32[4]{0}, f32[3,4]{1,0}) parameter(0)
  %step = s64[] get-tuple-element(%state), index=0
  %carry = f32[4]{0} get-tuple-element(%state), index=1
  %copy.2 = f32[4]{0} copy(%carry)
  %stacked = f32[3,4]{1,0} get-tuple-element(%state), index=2
  %update = f32[3,4]{1,0} fusion(%stacked, %copy.2, %step), kind=kLoop, calls=%fused_update
  %one = s64[] constant(1)
  %next = s64[] add(%step, %one)
  ROOT %tuple = (s64[], f32[4]{0}, f32[3,4]{1,0}) tuple(%next, %copy.2, %update)
}

%condition (state: (s64[], f32[4], f32[3,4])) -> pred[] {
  %state = (s64[], f32[4]{0}, f32[3,4]{1,0}) parameter(0)
  %step = s64[] get-tuple-element(%state), index=0
  %three = s64[] constant(3)
  ROOT %less = pred[] compare(%step, %three), direction=LT
}

ENTRY %main (carry: f32[4], stacked: f32[3,4]) -> (s64[], f32[4], f32[3,4]) {
  %carry = f32[4]{0} parameter(0)
  %stacked = f32[3,4]{1,0} parameter(1)
  %copy.3 = f32[3,4]{1,0} copy(%stacked)
  %zero = s64[] constant(0)
  %init = (s64[], f32[4]{0}, f32[3,4]{1,0}) tuple(%zero, %carry, %copy.3)
  ROOT %while = (s64[], f32[4]{0}, f32[3,4]{1,0}) while(%init), condition=%condition, body=%body
}
"""


def test_the_parser_finds_a_stacked_copy_inside_a_loop_only():
    # copy.1 (in the fusion the body calls) counts; copy.2 (a carry) and
    # copy.3 (before the loop, once per call) do not.
    assert while_loops(LOOP_WITH_A_STACKED_COPY, 3) == [("body", {("f32", "3,4")})]
    copies = stacked_copies_in_loops(LOOP_WITH_A_STACKED_COPY, 3)
    assert copies == ["fused_update: %copy.1 = f32[3,4]{1,0} copy(%param_0)"]


def test_the_parser_finds_the_copies_of_a_merged_initial_buffer():
    hlo = LOOP_WITH_A_STACKED_COPY.replace("%copy.3 = f32[3,4]{1,0} copy(%stacked)",
                                           "%copy.3 = f32[3,4]{1,0} copy(%broadcast.1)")
    assert copies_of_initial_buffers(hlo, 3) == ["%copy.3 = f32[3,4]{1,0} copy(%broadcast.1)"]
    assert copies_of_initial_buffers(LOOP_WITH_A_STACKED_COPY, 3) == []


@pytest.mark.parametrize("block", ["ours", "fused_qkv_sdpa", "llama"])
def test_layer_stack_training_step_copies_no_stacked_buffer(run_isolated, tmp_path, block):
    flags = dump_flags(tmp_path)
    result = run_isolated(training_step_scenario, args=(block,),
                          env={"XLA_FLAGS": flags})
    assert result.returncode == 0, result.stderr[-3000:]
    dumps = [open(path).read() for path in glob.glob(f"{tmp_path}/*after_optimizations.txt")]
    step, = [hlo for hlo in dumps if " while(" in hlo]
    loops = while_loops(step, LAYERS)
    # The forward loop and the backward loop, each with stacked buffers.
    assert len(loops) == 2 and all(stacked for _, stacked in loops), loops
    assert stacked_copies_in_loops(step, LAYERS) == []
    assert copies_of_initial_buffers(step, LAYERS) == []
