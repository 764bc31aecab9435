"""The simulator's direct path (issue 17 item 5): a torch binding seen to be one aten op on the
same arguments goes to that op's handler without the round trip through torch's dispatcher.
It must do what the round trip does: the same values and result types, version counters
bumped for what an op writes, and nothing skipped that a user's own torch mode, or autocast,
would have seen."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from pinstage.testing import MODES, simulated_accelerator

pytestmark = pytest.mark.timeout(300)

CALLS = 3  # the first call of a kind goes through torch (and is learned), the rest direct


def _as_on_cpu(program: Callable[[str], object], mode: str) -> None:
    """``program(device)`` gives in the simulator (``mode``) what it gives on CPU tensors."""
    expected = program("cpu")
    with simulated_accelerator(mode):
        got = program("cuda")
    assert got == expected


def _program(device: str) -> list[object]:
    """Small ops, each called CALLS times, on ``device``: what they give, as host values."""
    out: list[object] = []
    x = torch.arange(6, dtype=torch.float32, device=device)
    y = torch.ones(6, dtype=torch.float32, device=device)
    i = torch.arange(6, device=device)
    m = torch.arange(12.0, device=device).reshape(3, 4)
    for _ in range(CALLS):
        out.append((x + y).tolist())
        out.append((x * 2).tolist())
        out.append((i * 2.5).tolist())  # (an int tensor times a float: promotes)
        out.append(torch.sub(x, y, alpha=3).tolist())
        out.append((x > 2).tolist())
        out.append(torch.where(x > 2, x, y).tolist())
        out.append((x.sum().item(), m.sum(dim=1).tolist(), torch.clamp(x, min=2.0).tolist()))
        x.add_(1)
        y.mul_(2)
        out.append(x.tolist())
        out.append(y.tolist())
        top = m.max(dim=0)
        out.append((type(top).__name__, top.values.tolist(), top.indices.tolist()))
        out.append([t.tolist() for t in m.split(2, dim=1)])
        out.append((x._version, y._version))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_repeated_ops_give_what_cpu_gives(mode):
    """Learned and direct calls give the CPU's values, result types (``max`` a named tuple)
    and version counters (each in-place op bumps its tensor's once)."""
    _as_on_cpu(_program, mode)


class _CountingDispatch(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _CountingFunction(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen.append(getattr(func, "__name__", "?"))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", MODES)
def test_a_users_dispatch_mode_sees_every_call(mode):
    """A dispatch mode the user enters inside the simulator (a FlopCounter, a logging mode,
    CSAN's) sees each op, learned ones too: the direct path steps aside."""
    with simulated_accelerator(mode):
        x = torch.zeros(4, device="cuda")
        for _ in range(CALLS):  # learned before the mode is entered
            x.add_(1)
        with _CountingDispatch() as counting:
            for _ in range(CALLS):
                x.add_(1)
        assert counting.seen.count("add_") == CALLS
        assert x.tolist() == [2.0 * CALLS] * 4


@pytest.mark.parametrize("mode", MODES)
def test_a_users_function_mode_below_the_simulators_sees_every_call(mode):
    """A function mode entered before the simulator opened sits below the simulator's: each
    call still reaches it."""
    with _CountingFunction() as counting:
        with simulated_accelerator(mode):
            x = torch.zeros(4, device="cuda")
            for _ in range(2 * CALLS):
                x.add_(1)
            assert x.tolist() == [2.0 * CALLS] * 4
    assert counting.seen.count("add_") == 2 * CALLS


def _indexing(device: str) -> list[object]:
    """Basic indexing (a view, made on the host tensor) and assignment through it, and the
    other indexing that still goes through torch, on ``device``."""
    out: list[object] = []
    x = torch.arange(8.0, device=device)
    m = torch.arange(12.0, device=device).reshape(3, 4)
    for _ in range(CALLS):
        out.append([x[1:5].tolist(), x[2].item(), x[-1].item(), x[::3].tolist(),
                    m[1, ::2].tolist(), m[..., 1].tolist(), m[None, 1:3].shape,
                    m[:, -2:].stride(), m[1:, 1:].storage_offset()])
        v = x[1:3]
        v.fill_(7.0)  # (the view writes its base's memory)
        x[5:7] = 2.5
        x[0] = True
        m[1] = 4
        m[:, 3] = x[:3]  # (a device tensor, copied into the view)
        m[torch.tensor([0, 2], device=device)] = -1.0  # (advanced indexing: through torch)
        i = torch.tensor([3, 1, 1], device=device)
        out.append([x[i].tolist(), m[torch.tensor([[0], [2]], device=device)].tolist(),
                    x[i.int()].tolist(), x[x > 4].tolist()])
        n = torch.tensor(3, device=device)
        out.append(x[:n].tolist())  # (a bound read from the device: through torch)
        out.append([x.tolist(), m.tolist()])
        with pytest.raises(IndexError) as err:
            x[8]
        out.append(str(err.value))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_basic_indexing_gives_what_cpu_gives(mode):
    _as_on_cpu(_indexing, mode)


@pytest.mark.parametrize("mode", MODES)
def test_a_users_dispatch_mode_sees_basic_indexing(mode):
    with simulated_accelerator(mode):
        x = torch.zeros(8, device="cuda")
        x[1:3] = 1.0
        with _CountingDispatch() as counting:
            y = x[1:3]
            x[4:6] = 2.0
        assert "slice" in counting.seen and "fill_" in counting.seen
        assert y.tolist() == [1.0, 1.0]
        assert x.tolist() == [0.0, 1.0, 1.0, 0.0, 2.0, 2.0, 0.0, 0.0]


@pytest.mark.parametrize("mode", MODES)
def test_an_assignment_through_basic_indexing_on_a_side_stream_is_checked_for_races(mode):
    from pinstage.testing import HazardError

    with simulated_accelerator(mode):
        x = torch.zeros(8, device="cuda")
        side = torch.cuda.Stream()
        y = x * 2  # read on the default stream
        with torch.cuda.stream(side), pytest.raises(HazardError, match="fill_"):
            x[0:4] = 1.0  # written on the side stream, not ordered after the read
        del y


def test_a_users_dispatch_mode_does_not_see_the_simulators_kernels_run():
    """The simulator runs a queued op's kernel on host tensors when the host waits (lazy
    mode's synchronize): those are not the user's torch calls, and a user's dispatch mode
    open then does not see them (on a GPU it would not either)."""
    with simulated_accelerator("lazy"):
        x = torch.zeros(4, device="cuda")
        for _ in range(CALLS):
            x.add_(1)
        with _CountingDispatch() as counting:
            torch.cuda.synchronize()
        assert counting.seen == []
        assert x.tolist() == [float(CALLS)] * 4


def _decompositions(device: str) -> list[object]:
    """Bindings that torch decomposes into another aten op chosen by their arguments'
    values or shapes (narrow -> slice, matmul -> mm/mv/dot, diag, conj): each call must be
    taken anew, never as the op the first call dispatched."""
    x = torch.arange(6.0, device=device)
    a, b, v = (torch.ones(2, 3, device=device), torch.ones(3, 2, device=device),
               torch.ones(3, device=device))
    c = torch.ones(2, dtype=torch.complex64, device=device)
    out: list[object] = []
    for _ in range(2):
        out.append([x.narrow(0, s, 2).tolist() for s in (0, 1, 3)])
        out.append([(a @ b).tolist(), (v @ b).tolist(), (a @ v).tolist(), (v @ v).item()])
        out.append([torch.matmul(v, v).item(), torch.matmul(a, b).tolist()])
        out.append([v.diag().shape, torch.ones(3, 3, device=device).diag().tolist()])
        out.append([c.conj().resolve_conj().tolist(), x.conj().tolist()])
    return out


@pytest.mark.parametrize("mode", MODES)
def test_decomposed_bindings_are_never_taken_for_the_op_they_first_dispatched(mode):
    _as_on_cpu(_decompositions, mode)


def _assignments(device: str) -> list[object]:
    out: list[object] = []
    for dtype, value in ((torch.float16, 1e40), (torch.int64, 1.5), (torch.uint8, 300),
                         (torch.float32, True), (torch.bfloat16, -1e39), (torch.uint8, -1),
                         (torch.int64, 2**70), (torch.float32, 4), (torch.int8, 200),
                         (torch.int32, -7), (torch.float16, 65504.0), (torch.float16, 7e4),
                         (torch.float64, 2.5), (torch.bool, 3), (torch.float32, 1e40),
                         (torch.float32, -1e40), (torch.int32, 2**40), (torch.float32, 2**70)):
        x = torch.zeros(4, dtype=dtype, device=device)
        try:  # (as torch's binding: a tensor of x's dtype, overflow refused but for float16
            # and bfloat16, which make it inf; an int past int64 refused by its parser)
            x[1:3] = value
            out.append(x.cpu().tolist())
        except (RuntimeError, ValueError) as exc:
            out.append((type(exc).__name__, str(exc), x.cpu().tolist()))
    host = torch.zeros(4)
    host[1:3] = torch.ones(2, device=device)  # (a host tensor's slice, from the device)
    out.append(host.tolist())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_assignments_through_basic_indexing_convert_values_as_torch_does(mode):
    _as_on_cpu(_assignments, mode)


@pytest.mark.parametrize("mode", MODES)
def test_in_place_view_ops_leave_queued_kernels_their_shapes(mode):
    """A kernel queued before x.t_() (lazy mode: not run yet) still sees x as it was."""
    def program(device: str) -> list[object]:
        x = torch.arange(6.0, device=device).view(2, 3)
        x.add_(torch.tensor([10.0, 20.0, 30.0], device=device))  # (a row, broadcast)
        x.t_()
        y = torch.empty(2, 3, device=device)
        y.copy_(torch.arange(6.0, device=device).view(2, 3))
        y.unsqueeze_(0)
        return [x.cpu().tolist(), y.cpu().tolist()]

    _as_on_cpu(program, mode)


@pytest.mark.parametrize("mode", MODES)
def test_inference_mode_is_kept_by_learned_and_reused_calls(mode):
    """Learned calls and reused memory keep torch's inference-mode rules: an inference
    tensor updated in place outside the mode is torch's error, memory an inference-mode
    tensor had is an ordinary tensor's next."""
    with simulated_accelerator(mode):
        x = torch.ones(3, device="cuda")
        for _ in range(CALLS):
            x.add_(1)
            x.mul(2)
        with torch.inference_mode():
            y = torch.ones(3, device="cuda")
            z = x.mul(2)
            assert z.is_inference()
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            y.add_(1)
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            y.copy_(x)  # (copy_'s own direct path)
        assert not x.mul(2).is_inference()
        del y, z
        b = torch.zeros(3, device="cuda")  # (memory an inference tensor had)
        b.add_(1)
        assert (b * 2).tolist() == [2.0] * 3 and not b.is_inference()


def _assignments_and_inference(device: str) -> list[object]:
    """In-place writes by assignment and by the methods that go through a proxy: the
    version counters they bump, and inference tensors refusing them outside inference
    mode; a view made in inference mode of a normal tensor."""
    out: list[object] = []
    with torch.inference_mode():
        t = torch.ones(4, device=device)
    for write in (lambda: t.__setitem__(slice(1, 3), 2.0), lambda: t.__setitem__(0, 1),
                  lambda: t.__setitem__(slice(0, 2), torch.zeros(2, device=device)),
                  lambda: t.add_(1), lambda: t.masked_fill_(t > 0, 3.0)):
        for _ in range(CALLS):
            try:
                write()
                out.append("written")
            except RuntimeError as exc:
                out.append(str(exc))
    x = torch.zeros(4, device=device)
    for _ in range(CALLS):
        x[1:3] = 2.0
        x[0] = 1
        x[0:2] = torch.ones(2, device=device)
        x[torch.tensor([3], device=device)] = 5.0
        x.masked_fill_(x > 4, 0.5)
        x.index_fill_(0, torch.tensor([0], device=device), 7.0)
        out.append(x._version)
    with torch.inference_mode():
        x[1:3] = 4.0  # (its view of a normal tensor is normal: it raised here)
        out.append(x.view(2, 2).is_inference())
    out.append(x._version)
    out.append(x.tolist())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_assignments_bump_versions_and_respect_inference_tensors(mode):
    """``x[1:3] = 2.0`` bumps ``x._version`` (torch's view shares it), so do in-place
    methods that run on a proxy (``masked_fill_``, ``index_fill_``, advanced assignment);
    on an inference tensor outside inference mode each raises torch's error; assigning into
    a normal tensor in inference mode works: as on CPU."""
    _as_on_cpu(_assignments_and_inference, mode)


def _assignment_errors(device: str) -> list[object]:
    """Assignments that fail, each for one reason or several: the error torch raises first
    (the value's conversion, then the indexing, then the inference tensor)."""
    out: list[object] = []
    x = torch.zeros(4, device=device)
    with torch.inference_mode():
        t = torch.zeros(4, device=device)
    for target in (x, t):
        for idx, value in ((10, 1e40), (slice(None, None, -1), 1e40), (10, 1.0),
                           (slice(None, None, -1), 1.0), (0, 1e40), (0, 1.0), (10, True)):
            try:
                target[idx] = value
                out.append("assigned")
            except (RuntimeError, IndexError, ValueError) as exc:
                out.append((type(exc).__name__, str(exc)))
    out.append(x.tolist())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_failing_assignments_raise_torchs_first_error(mode):
    """An assignment with a bad index, a value that overflows, into an inference tensor
    (or several of these) raises the error torch raises first, as on CPU."""
    _as_on_cpu(_assignment_errors, mode)


def _views(device: str) -> list[object]:
    """View bindings called again and again: each result a view of its base (``_base``,
    the base's version counter moved by a write through the view)."""
    out: list[object] = []
    for _ in range(CALLS):
        b = torch.zeros(600, device=device)
        for view in (lambda t: t.select(0, 300), lambda t: t.select(0, 3),
                     lambda t: t.unsqueeze(0), lambda t: t.expand(2, 600),
                     lambda t: t.narrow(0, 1, 2), lambda t: t.as_strided((2,), (3,), 7)):
            v = view(b)
            before = b._version
            if not v._is_view() or v._base is not b:
                out.append(("not a view", v._is_view()))
            v2 = view(b)
            (v2 if v2.dim() == 0 or v2.stride(0) != 0 else v2.select(0, 0)).add_(1)
            out.append((v._base is b, b._version - before))
        m = torch.zeros(3, 4, device=device)
        for view in (lambda t: t.t(), lambda t: t.transpose(0, 1), lambda t: t.permute(1, 0)):
            v = view(m)
            before = m._version
            v.mul_(2)
            out.append((v._base is m, m._version - before))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_view_bindings_give_views_of_their_base_every_call(mode):
    """A view op's result is a view of its base on every call, not only the first (the
    direct path never takes a view op: torch's ADInplaceOrView kernel makes the view)."""
    _as_on_cpu(_views, mode)


def _view_calls(device: str) -> list[object]:
    out: list[object] = []
    for _ in range(CALLS):
        x = torch.arange(6.0, device=device)
        for view in (lambda t: t.view(2, 3), lambda t: t.view(-1), lambda t: t.view((3, 2)),
                     lambda t: t.view(torch.int32), lambda t: t.view(torch.uint8),
                     lambda t: t.view_as(torch.empty(3, 2))):
            v = view(x)
            before = x._version
            v.add_(1) if v.dtype.is_floating_point else v.fill_(0)
            out.append((tuple(v.shape), v.dtype, v._base is x, x._version - before))
        out.append(x.tolist())
    return out


@pytest.mark.parametrize("mode", MODES)
def test_view_gives_a_view_of_its_base(mode):
    """``x.view(shape)`` and ``x.view(dtype)`` are views of ``x`` (``_base``, a write through
    them moves ``x``'s version counter), with their values, as on CPU."""
    _as_on_cpu(_view_calls, mode)


def _inference_views(device: str) -> list[object]:
    out: list[object] = []
    with torch.inference_mode():
        t = torch.zeros(4, 2, device=device)
        made_inside = t.t()
    x = torch.zeros(4, 2, device=device)
    for _ in range(CALLS):
        for v in (t.t(), t.select(0, 1), t.view(8), t.unsqueeze(0), x.t(), made_inside):
            out.append(v.is_inference())
        with torch.inference_mode():
            out.append((x.t().is_inference(), t.t().is_inference(), (x + 1).is_inference()))
    return out


@pytest.mark.parametrize("mode", MODES)
def test_a_view_is_an_inference_tensor_if_its_base_is(mode):
    """Views of an inference tensor are inference tensors, in inference mode or not; views
    of a normal one are normal; a new result in inference mode is one, as on CPU."""
    _as_on_cpu(_inference_views, mode)


@pytest.mark.parametrize("mode", ["eager", "lazy", "random"])
def test_assigning_data_takes_the_other_tensors_memory(mode):
    """``x.data = y`` (torch's set_data): x reads and writes y's memory, with y's shape and
    dtype, and keeps it after y is gone (the memory is not handed to a new owner); between
    a simulated tensor and a CPU tensor it is refused, naming both."""
    with simulated_accelerator(mode, seed=1):
        x = torch.zeros(4, device="cuda")
        y = torch.arange(6, dtype=torch.float64, device="cuda").view(2, 3)
        version = x._version
        x.data = y
        assert x.shape == (2, 3) and x.dtype == torch.float64 and x.device.type == "cuda"
        assert x.data_ptr() == y.data_ptr() and x._version == version
        del y
        z = torch.full((2, 3), 7.0, dtype=torch.float64, device="cuda")  # (not y's memory)
        x.add_(1)
        assert x.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
        assert z.tolist() == [[7.0] * 3] * 2
        with pytest.raises(NotImplementedError, match="simulated cuda tensor and y a cpu"):
            x.data = torch.ones(2, 3, dtype=torch.float64)
        assert x.tolist() == [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]]
