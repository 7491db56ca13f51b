"""In-place writes inside a scanned fn leave what the for loop leaves: captured
tensors and xs written after the loop, every step seeing the earlier steps'
writes; what scan cannot write as the loop does raises when fn is traced."""
import copy

import pytest
import torch
import torch_xla
from torch import nn

import torch_xla_ext as tx
from reference import scan_loop
from tolerances import ACCUMULATED, close

DEV = torch_xla.device()


def counter_scenario():
    """A tensor the step captures and adds to in place counts as in a for loop."""
    dev = torch_xla.device()
    counter = torch.zeros((), device=dev)
    weight = torch.tensor([1.0, 0.5], device=dev, requires_grad=True)

    def fn(c, x):
        counter.add_(1.0)
        return c * weight + counter + x, None

    def loop(init, xs):
        c = init
        for i in range(xs.shape[0]):
            c, _ = fn(c, xs[i])
        return c

    init, xs = torch.zeros(2, device=dev), torch.arange(6.0, device=dev).reshape(3, 2)
    for grad in (False, True):
        with torch.set_grad_enabled(grad):
            for call in range(2):  # the second call is a cache hit and goes on counting
                start = counter.clone()
                scanned = tx.scan(fn, init, xs)[0]
                scanned_counter = counter.clone()
                counter.copy_(start)
                looped = loop(init, xs)
                assert torch.allclose(scanned.cpu(), looped.cpu()), (scanned.cpu(), looped.cpu())
                assert torch.equal(scanned_counter.cpu(), counter.cpu()), (scanned_counter, counter)
                if grad:
                    scanned.sum().backward()
                    scan_grad, weight.grad = weight.grad, None
                    looped.sum().backward()
                    assert torch.allclose(scan_grad.cpu(), weight.grad.cpu()), \
                        (scan_grad, weight.grad)
                    weight.grad = None
    torch_xla.sync()
    assert counter.item() == 12.0, counter
    assert tx.cache_info().misses == 1, tx.cache_info()
    print("ok")


def test_captured_counter_counts_as_in_the_loop(run_isolated):
    # The case: it crashed the process (SIGSEGV) when the result was read.
    result = run_isolated(counter_scenario)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("ok")


def test_capture_written_and_read_in_the_same_step():
    torch.manual_seed(0)
    average = torch.zeros(3, device=DEV)
    lin = nn.Linear(3, 3).to(DEV)

    def fn(c, x):
        average.mul_(0.5).add_(x.mean(0))  # every step reads the previous steps' average
        h = torch.tanh(lin(c) + average)
        return h, average.sum()

    init = torch.randn(2, 3, device=DEV, requires_grad=True)
    xs = torch.randn(4, 2, 3, device=DEV)
    carry, ys = tx.scan(fn, init, xs)
    (carry.sum() + ys.sum()).backward()
    scan_grads = [init.grad, lin.weight.grad]
    scan_average = average.clone()
    init.grad = lin.weight.grad = lin.bias.grad = None
    average.zero_()
    loop_carry, loop_ys = scan_loop(fn, init, xs)
    (loop_carry.sum() + loop_ys.sum()).backward()
    close(carry, loop_carry, ACCUMULATED)
    close(ys, loop_ys, ACCUMULATED)
    close(scan_average, average, ACCUMULATED)
    for scanned, looped in zip(scan_grads, [init.grad, lin.weight.grad]):
        close(scanned, looped, ACCUMULATED)


@pytest.mark.parametrize("write", [
    lambda buf, x: buf.copy_(x * 2),
    lambda buf, x: buf.mul_(x),
    lambda buf, x: buf.__setitem__(1, buf[0] + x[1]),    # buf[1] = ...
    lambda buf, x: buf[1:].add_(x[1:]),                  # through a view
    lambda buf, x: torch.add(buf, x, out=buf),
], ids=["copy_", "mul_", "index_assignment", "view_add_", "out="])
def test_each_kind_of_write_to_a_capture(write):
    buf = torch.tensor([1.0, 2.0, 3.0], device=DEV)
    start = buf.clone()

    def fn(c, x):
        write(buf, x)
        return c + buf, None

    init, xs = torch.zeros(3, device=DEV), torch.arange(1.0, 13.0, device=DEV).reshape(4, 3)
    carry, _ = tx.scan(fn, init, xs)
    scanned = buf.clone()
    buf.copy_(start)
    close(carry, scan_loop(fn, init, xs)[0], ACCUMULATED)
    close(scanned, buf, ACCUMULATED)


@pytest.mark.parametrize("read_before", [False, True])
def test_capture_overwritten_whole(read_before):
    # copy_ writes the capture's data in place: its old value is then read by
    # the step's other outputs only (or by nothing).
    buf = torch.tensor([1.0, 2.0], device=DEV)

    def fn(c, x):
        old = buf.sum() if read_before else x.sum()
        buf.copy_(c + x)
        return c + buf, old

    init, xs = torch.ones(2, device=DEV), torch.arange(6.0, device=DEV).reshape(3, 2)
    carry, ys = tx.scan(fn, init, xs)
    scanned = buf.clone()
    buf.copy_(torch.tensor([1.0, 2.0]))
    loop_carry, loop_ys = scan_loop(fn, init, xs)
    close(carry, loop_carry, ACCUMULATED)
    close(ys, loop_ys, ACCUMULATED)
    close(scanned, buf, ACCUMULATED)


def test_batchnorm_in_fn_updates_its_running_statistics_as_the_loop():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)).to(DEV).train()
    reference = copy.deepcopy(block)

    def step(module):
        return lambda c, x: (torch.tanh(module(c) + x), module[1].running_mean.sum())

    init = torch.randn(4, 3, device=DEV, requires_grad=True)
    xs = torch.randn(5, 4, 3, device=DEV)
    carry, ys = tx.scan(step(block), init, xs)
    (carry.sum() + ys.sum()).backward()
    scan_init_grad, init.grad = init.grad, None
    loop_carry, loop_ys = scan_loop(step(reference), init, xs)
    (loop_carry.sum() + loop_ys.sum()).backward()
    close(carry, loop_carry, ACCUMULATED)
    close(ys, loop_ys, ACCUMULATED)
    close(scan_init_grad, init.grad, ACCUMULATED)
    for (name, scanned), looped in zip(block.state_dict().items(), reference.state_dict().values()):
        close(scanned, looped, ACCUMULATED, name)
    assert block[1].num_batches_tracked.item() == 5
    for scanned, looped in zip(block.parameters(), reference.parameters()):
        close(scanned.grad, looped.grad, ACCUMULATED)


@pytest.mark.parametrize("reverse", [False, True])
def test_x_slices_written_in_place_are_written_into_xs(reverse):
    # In the loop the slice is a view of xs: writing it writes xs.
    def fn(c, x):
        x.mul_(2).add_(c)
        return c + x, x.sum()

    init = torch.ones(2, device=DEV)
    xs = torch.arange(8.0, device=DEV).reshape(4, 2)
    looped_xs = xs.clone()
    carry, ys = tx.scan(fn, init, xs, reverse=reverse)
    loop_carry, loop_ys = scan_loop(fn, init, looped_xs, reverse=reverse)
    close(carry, loop_carry, ACCUMULATED)
    close(ys, loop_ys, ACCUMULATED)
    close(xs, looped_xs, ACCUMULATED)


def test_carry_written_in_place_counts_within_its_step_and_init_is_kept():
    # What fn returns is the next carry; init is a value scan never writes
    # (the loop would write init itself on its first step).
    weight = torch.tensor([0.5, 2.0], device=DEV, requires_grad=True)

    def fn(c, x):
        c.mul_(weight)
        c += x
        return c, c.sum()

    init = torch.ones(2, device=DEV)
    xs = torch.arange(6.0, device=DEV).reshape(3, 2)
    carry, ys = tx.scan(fn, init, xs)
    (carry.sum() + ys.sum()).backward()
    scan_grad, weight.grad = weight.grad, None
    loop_carry, loop_ys = scan_loop(fn, init.clone(), xs)
    (loop_carry.sum() + loop_ys.sum()).backward()
    close(carry, loop_carry, ACCUMULATED)
    close(ys, loop_ys, ACCUMULATED)
    close(scan_grad, weight.grad, ACCUMULATED)
    close(init, torch.ones(2), ACCUMULATED)


def test_writing_a_carry_that_requires_grad_raises_as_the_loop():
    # torch_xla's own test_scan_input_in_place_mutation: a leaf init that
    # requires grad cannot be written in place, in the loop or in scan.
    def fn(carry, x):
        carry.add_(x)
        return carry, x.clone().add_(42)

    init = torch.zeros(2, device=DEV, requires_grad=True)
    xs = torch.ones(3, 2, device=DEV, requires_grad=True)
    with pytest.raises(RuntimeError, match="in-place operation"):
        scan_loop(fn, init, xs)
    with pytest.raises(RuntimeError, match="in-place operation"):
        tx.scan(fn, init, xs)


class _Holder(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))
        self.register_buffer("total", torch.zeros(2))
        self.register_buffer("table", torch.zeros(3, 2))


def _unsupported_writes():
    holder = _Holder().to(DEV)
    row = holder.table[0]
    host = torch.zeros(2)

    def parameter_under_no_grad(c, x):
        with torch.no_grad():
            holder.weight.mul_(0.5)
        return c * holder.weight, None

    def resize(c, x):
        holder.total.resize_(4)
        return c, None

    def value_with_grad(c, x):
        holder.total.copy_(c * holder.weight)
        return c + x, None

    def view_and_base(c, x):
        row.add_(x)
        return c + holder.table.sum(0), None

    def host_tensor(c, x):
        host.add_(1.0)
        return c + x, None

    return [
        (parameter_under_no_grad, TypeError,
         r"writes in place to the float32\[2\] tensor fn captures as <closure holder>\.weight, "
         r"which requires grad"),
        (resize, ValueError,
         r"changes the float32\[2\] tensor fn captures as <closure holder>\.total to a "
         r"float32\[4\] tensor in place"),
        (value_with_grad, TypeError,
         r"writes a value that requires grad into the float32\[2\] tensor fn captures as "
         r"<closure holder>\.total"),
        (view_and_base, ValueError,
         r"writes in place to the float32\[2\] tensor fn captures as <closure row>, which shares "
         r"memory with the float32\[3,2\] tensor fn captures as <closure holder>\.table"),
        (host_tensor, TypeError, r"writes in place \(add_\) to a float32\[2\] tensor on cpu"),
    ]


@pytest.mark.parametrize("fn, error, match", _unsupported_writes(),
                         ids=lambda case: getattr(case, "__name__", None))
def test_unsupported_write_names_the_tensor_and_the_process_goes_on(fn, error, match):
    init = torch.ones(2, device=DEV, requires_grad=True)
    with pytest.raises(error, match=match):
        tx.scan(fn, init, torch.ones(3, 2, device=DEV))
    carry, _ = tx.scan(lambda c, x: (c + x, None), torch.zeros(2, device=DEV),
                       torch.ones(3, 2, device=DEV))
    assert carry.cpu().tolist() == [3.0, 3.0]
