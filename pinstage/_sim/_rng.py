"""Random numbers on the simulated device, modelled on CUDA's Philox generators.

A device generator (``torch.cuda.default_generators[i]``, ``torch.Generator(device="cuda")``)
is a :class:`SimGenerator`: its state is a seed and an offset, 16 bytes as on CUDA (seed,
then offset, little-endian ``uint64``). Every random kernel takes the generator's
``(seed, offset)`` when it is *launched* (on the host, in program order) and advances the
offset by 4; the kernel draws its values from a private CPU generator seeded from that pair.
So values depend only on the seed and the order of launches, never on when the queued work
runs (every mode and schedule gives the same numbers), and:

* seeding again, or restoring a saved state, replays the same sequence;
* a kernel captured in a CUDA graph takes no offset at capture; each replay reserves the
  graph's offsets from each generator state its kernels were captured with (4 per random
  kernel; switching states with ``graphsafe_set_state`` after the capture does not move
  them) and its kernels
  draw from them: fresh values at every replay, and the same values as the same kernels run
  eagerly from the same generator state (guaranteed by construction, for any number of
  generators, with the kernels in capture order);
* the numbers are not CUDA's (a CPU Mersenne Twister draws them, the offsets advance per
  kernel rather than per element): code may rely on reproducibility, not on values.

``native_dropout`` and the ``*_like`` factories are decomposed into an in-place random kernel
(``bernoulli_``, ``uniform_``, ``normal_``, ``random_``), so they follow the same rule.
"""

from __future__ import annotations

import itertools
import secrets
import threading
import weakref
from typing import Any

import torch

from ._core import SimState, current
from ._sched import Op
from ._tensor import _DEFAULTS, FACTORIES, empty_device, is_device, register_op

__all__ = ["SimGenerator", "RANDOM_FACTORIES", "random_factory", "cuda_names", "install",
           "replay_fn", "replay_bases", "forget", "DEFAULT_SEED"]

aten = torch.ops.aten
DEFAULT_SEED = 67280421310721  # the seed CUDA's default generators start from, as in c10
_MASK64 = (1 << 64) - 1
_RealGenerator = torch._C.Generator
# A SimGenerator's underlying CPU generator is never drawn from: its seed is a tag that
# identifies it when the dispatcher hands the generator back as a plain torch.Generator.
_TAG_BASE = 0x5157_0000_0000_0000
_tags = itertools.count(1)
_by_tag: weakref.WeakValueDictionary[int, SimGenerator] = weakref.WeakValueDictionary()
_take_lock = threading.Lock()  # (launches from several host threads take distinct offsets)


def _mix(seed: int, offset: int) -> int:
    """The private CPU seed of the kernel launched at ``(seed, offset)`` (splitmix64)."""
    z = (seed ^ (offset * 0x9E3779B97F4A7C15)) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


class SimGenerator(_RealGenerator):
    """A generator of a simulated CUDA device (see the module doc): ``manual_seed``, ``seed``,
    ``initial_seed``, ``get_state``/``set_state`` (16 bytes), ``get_offset``/``set_offset``
    and ``clone_state`` as on CUDA. It is a ``torch.Generator``, so torch's functions accept
    it where a generator is asked for."""

    _st: list[int]  # [seed, offset]: shared by the generators graphsafe_get_state links
    _index: int

    @property
    def _seed(self) -> int:
        return self._st[0]

    @_seed.setter
    def _seed(self, value: int) -> None:
        self._st[0] = value

    @property
    def _offset(self) -> int:
        return self._st[1]

    @_offset.setter
    def _offset(self, value: int) -> None:
        self._st[1] = value

    def __new__(cls, index: int = 0, seed: int = DEFAULT_SEED) -> SimGenerator:
        self = super().__new__(cls)
        tag = _TAG_BASE + next(_tags)
        _RealGenerator.manual_seed(self, tag)
        _by_tag[tag] = self
        self._index, self._st = int(index), [int(seed) & _MASK64, 0]
        return self

    def __init__(self, index: int = 0, seed: int = DEFAULT_SEED) -> None:
        pass

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", self._index)

    def manual_seed(self, seed: Any) -> SimGenerator:  # type: ignore[override]
        if isinstance(seed, bool) or not isinstance(seed, int):
            try:
                seed = int(seed)
            except (TypeError, ValueError):
                raise TypeError(f"manual_seed expected an int seed, got {seed!r}") from None
        sim = current()
        if sim is not None and seed & _MASK64 != self._seed and \
                sim.sched.current_stream(self._index).capture is not None:
            raise RuntimeError(  # (CUDA's generator refuses it: the graph's kernels took seeds)
                "CUDAGeneratorImpl::set_current_seed can be called during stream capture only "
                "if new seed is the same as the original seed. (simulated)")
        self._seed, self._offset = seed & _MASK64, 0
        return self

    def seed(self) -> int:
        s = secrets.randbits(63)
        self.manual_seed(s)
        return s

    def initial_seed(self) -> int:
        return self._seed

    def get_state(self) -> torch.Tensor:
        data = self._seed.to_bytes(8, "little") + self._offset.to_bytes(8, "little")
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def set_state(self, new_state: Any) -> SimGenerator:  # type: ignore[override]
        if not isinstance(new_state, torch.Tensor) or new_state.dtype != torch.uint8 or \
                is_device(new_state):
            what = f"a tensor of {new_state.dtype} on {new_state.device}" \
                if isinstance(new_state, torch.Tensor) else type(new_state).__name__
            raise TypeError(f"RNG state must be a torch.ByteTensor (uint8, CPU), got {what}")
        if new_state.numel() != 16:
            raise ValueError(f"RNG state is wrong size: a simulated CUDA generator's state is "
                             f"16 bytes (seed, offset), got {new_state.numel()}")
        raw = bytes(new_state.contiguous().tolist())
        offset = int.from_bytes(raw[8:], "little")
        if offset % 4:
            raise ValueError(f"RNG state's offset must be a multiple of 4, got {offset}")
        self._seed, self._offset = int.from_bytes(raw[:8], "little"), offset
        return self

    def get_offset(self) -> int:
        return self._offset

    def set_offset(self, offset: int) -> SimGenerator:
        if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0 or offset % 4:
            raise ValueError(f"offset must be a non-negative multiple of 4, got {offset!r}")
        self._offset = offset
        return self

    def clone_state(self) -> SimGenerator:
        """A new generator with a copy of this one's state."""
        g = SimGenerator(self._index, self._seed)
        g._offset = self._offset
        return g

    def graphsafe_get_state(self) -> SimGenerator:
        """A generator over this one's state itself (drawing from either moves both)."""
        g = SimGenerator(self._index)
        g._st = self._st
        return g

    def graphsafe_set_state(self, state: Any) -> SimGenerator:  # type: ignore[override]
        """From now on this generator uses ``state``'s state (shared, not copied). Kernels
        captured before keep the state they were captured with, as on CUDA."""
        if not isinstance(state, SimGenerator):
            raise TypeError(f"graphsafe_set_state() expects a simulated CUDA generator, got "
                            f"{state!r}")
        self._st = state._st
        return self

    def take(self) -> tuple[int, int]:
        """A kernel's launch: its ``(seed, offset)``; the offset moves on by 4."""
        with _take_lock:
            key = (self._seed, self._offset)
            self._offset += 4
        return key

    def __repr__(self) -> str:
        return f"<simulated torch.Generator on cuda:{self._index}>"

    def __reduce__(self) -> Any:
        raise TypeError("a simulated CUDA generator cannot be pickled")


def _defaults(sim: SimState) -> list[SimGenerator]:
    gens: list[SimGenerator] | None = getattr(sim, "_rng_defaults", None)
    if gens is None:
        gens = [SimGenerator(i) for i in range(sim.device_count)]
        sim._rng_defaults = gens  # type: ignore[attr-defined]
    return gens


def _resolve(sim: SimState, gen: Any, index: int) -> SimGenerator:
    """The simulated generator of a kernel on device ``index`` (``gen`` as the user or the
    dispatcher passed it)."""
    if gen is None:
        return _defaults(sim)[index]
    if isinstance(gen, SimGenerator):
        found: SimGenerator | None = gen
    else:
        found = _by_tag.get(_RealGenerator.initial_seed(gen)) \
            if isinstance(gen, _RealGenerator) else None
    if found is None:
        dev = getattr(gen, "device", None)
        raise RuntimeError(f"Expected a 'cuda' device type for generator but found "
                           f"'{getattr(dev, 'type', dev)}'")
    if found._index != index:
        raise RuntimeError(f"a generator of cuda:{found._index} was given to a kernel on "
                           f"cuda:{index}")
    return found


def _launch(sim: SimState, gen: SimGenerator, index: int) -> tuple[torch.Generator, Any]:
    """A random kernel's private generator, seeded from ``gen``'s launch (under a capture:
    reseeded at each replay), and the capturing graph, if any."""
    stream = sim.sched.current_stream(index)
    private = torch.Generator()
    graph = stream.capture
    if graph is None:
        private.manual_seed(_mix(*gen.take()))
    return private, graph


def _note_captured(graph: Any, before: int, private: torch.Generator,
                   gen: SimGenerator) -> None:
    """Remember the op just captured into ``graph`` as a random kernel of ``gen``."""
    ops = graph.ops
    if len(ops) <= before:
        return
    rng = getattr(graph, "_rng_ops", None)
    if rng is None:
        rng = graph._rng_ops = {}
        graph._rng_count = {}
    # keyed by the generator's state, not the generator: graphsafe_set_state between two
    # captured kernels (a graph registers several states) gives each kernel its own state
    st = gen._st
    counts = graph._rng_count
    rel = counts.get(id(st), (st, 0))[1]
    counts[id(st)] = (st, rel + 4)
    rng[id(ops[-1])] = (private, st, rel, ops[-1])


def forget(graph: Any) -> None:
    """A graph captured anew or reset: its random kernels are gone."""
    graph.__dict__.pop("_rng_ops", None)
    graph.__dict__.pop("_rng_count", None)


def replay_fn(graph: Any, op: Any, bases: dict[Any, int]) -> Any:
    """The function a replay of ``graph`` queues for captured ``op``: random kernels first
    reseed their private generator from the offsets this replay reserved."""
    entry = getattr(graph, "_rng_ops", {}).get(id(op))
    if entry is None:
        return op.fn
    private, st, rel, _ = entry
    seed = _mix(st[0], bases[id(st)] + rel)
    fn = op.fn

    def run(reads: Any) -> Any:
        private.manual_seed(seed)
        return fn(reads)
    return run


def replay_bases(graph: Any) -> dict[Any, int]:
    """A replay's launch: each generator state its captured kernels drew from gives them its
    current offset and moves on past them (keyed by the state's id)."""
    bases: dict[Any, int] = {}
    with _take_lock:
        for key, (st, n) in getattr(graph, "_rng_count", {}).items():
            bases[key] = st[1]
            st[1] += n
    return bases


# --------------------------------------------------------------------------------------------
# kernels on simulated tensors


def _device_index(args: Any, kwargs: dict[str, Any]) -> int:
    for x in (*args, *kwargs.values()):
        if is_device(x):
            return int(x._sim_device.index or 0)
    return 0


class _Seeded:
    """An aten op that draws from ``private`` when it runs on host tensors, and runs without
    a generator on meta tensors (shape inference: some meta kernels refuse generators); the
    op as the simulator's default handler sees it, attributes delegated."""

    __slots__ = ("func", "private")

    def __init__(self, func: Any, private: torch.Generator) -> None:
        self.func, self.private = func, private

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if any(isinstance(x, torch.Tensor) and x.is_meta for x in (*args, *kwargs.values())):
            return self.func(*args, **kwargs)
        return self.func(*args, **kwargs, generator=self.private)

    @property
    def sim_wrapped(self) -> Any:
        """The aten op itself (the simulator's per-op plans and shape cache are its)."""
        return self.func

    def __getattr__(self, name: str) -> Any:
        return getattr(self.func, name)

    def __hash__(self) -> int:
        return hash(self.func)

    def __eq__(self, other: object) -> bool:
        return self.func == (other.func if isinstance(other, _Seeded) else other)


def _seeded_kernel(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """A random op with a ``generator`` argument on a simulated tensor."""
    index = _device_index(args, kwargs)
    gen = _resolve(sim, kwargs.get("generator"), index)
    private, graph = _launch(sim, gen, index)
    before = len(graph.ops) if graph is not None else 0
    kw = {k: v for k, v in kwargs.items() if k != "generator"}
    out = _DEFAULTS["op"](sim, _Seeded(func, private), args, kw)
    if graph is not None:
        _note_captured(graph, before, private, gen)
    return out


def _dropout(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    """``native_dropout``: a ``bernoulli_`` mask kernel and a scaling kernel, as CUDA's fused
    kernel computes (mask is ``bool``; kept values are scaled by ``1 / (1 - p)``)."""
    x, p = args[0], float(args[1] if len(args) > 1 else kwargs["p"])
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if train is False:
        return x.clone(), torch.ones_like(x, dtype=torch.bool)
    mask = torch.empty_like(x, dtype=torch.bool).bernoulli_(1.0 - p)
    scale = 0.0 if p >= 1.0 else 1.0 / (1.0 - p)
    return x * mask * scale, mask


def _like(fill: str) -> Any:
    def handler(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        x, rest = args[0], list(args[1:])
        kw = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format")}
        gen = kwargs.get("generator")
        out = torch.empty_like(x, **kw)
        if fill == "uniform":
            return out.uniform_(0.0, 1.0, generator=gen)
        if fill == "normal":
            return out.normal_(0.0, 1.0, generator=gen)
        low, high = (0, rest[0]) if len(rest) == 1 else (rest[0], rest[1])
        if "high" in kwargs:
            low, high = kwargs.get("low", 0), kwargs["high"]
        return out.random_(int(low), int(high), generator=gen)
    return handler


register_op(aten.bernoulli, aten.bernoulli_, aten.normal, aten.normal_, aten.uniform_,
            aten.random_, aten.exponential_, aten.geometric_, aten.cauchy_, aten.log_normal_,
            aten.multinomial, aten.poisson, aten.binomial, aten._standard_gamma,
            aten._sample_dirichlet, aten.rrelu_with_noise, aten.rrelu_with_noise_,
            aten._fused_dropout)(_seeded_kernel)
register_op(aten.native_dropout)(_dropout)
register_op(aten.rand_like)(_like("uniform"))
register_op(aten.randn_like)(_like("normal"))
register_op(aten.randint_like)(_like("int"))


# --------------------------------------------------------------------------------------------
# factories: torch.rand(..., device="cuda", generator=g)

RANDOM_FACTORIES = (torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal)


def random_factory(sim: SimState, func: Any, args: Any, kwargs: dict[str, Any],
                   index: int) -> Any:
    """A random factory on simulated device ``index``: a kernel that draws the values when it
    runs, from the private generator of its launch."""
    gen = _resolve(sim, kwargs.get("generator"), index)
    kw = {k: v for k, v in kwargs.items() if k not in ("generator", "device", "pin_memory")}
    meta = func(*args, **kw, device="meta")
    private, graph = _launch(sim, gen, index)
    out = empty_device(sim, meta.shape, meta.dtype, index, meta.stride())
    inner = out._inner
    stream = sim.sched.current_stream(index)
    before = len(graph.ops) if graph is not None else 0

    def run(_: Any) -> None:
        inner.copy_(func(*args, **kw, generator=private))

    sim.sched.enqueue(stream, Op(f"{func.__name__} (random factory kernel)", run,
                                 acc=(func.__name__, (), (inner,)), plain=True))
    if graph is not None:
        _note_captured(graph, before, private, gen)
    return out


# --------------------------------------------------------------------------------------------
# torch.cuda's random functions


def _index(sim: SimState, device: Any) -> int:
    if isinstance(device, str):
        device = torch.device(device)
    elif isinstance(device, int) and not isinstance(device, bool):
        device = torch.device("cuda", device)
    if isinstance(device, torch.device) and device.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {device}")
    return sim.sched.device_index(device)


def cuda_names(sim: SimState) -> dict[str, Any]:
    """``torch.cuda.manual_seed`` and the rest of ``torch.cuda.random`` over the simulated
    devices' default generators."""
    gens = _defaults(sim)
    sched = sim.sched

    def manual_seed(seed: Any) -> None:
        gens[sched.current_device()].manual_seed(int(seed))

    def manual_seed_all(seed: Any) -> None:
        for g in gens:
            g.manual_seed(int(seed))

    def seed() -> None:
        gens[sched.current_device()].seed()

    def seed_all() -> None:
        s = secrets.randbits(63)
        for g in gens:
            g.manual_seed(s)

    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return gens[_index(sim, device)].get_state()

    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        gens[_index(sim, device)].set_state(new_state)

    def set_rng_state_all(new_states: Any) -> None:
        for i, state in enumerate(new_states):
            gens[i].set_state(state)

    return {
        "manual_seed": manual_seed, "manual_seed_all": manual_seed_all, "seed": seed,
        "seed_all": seed_all, "initial_seed": lambda: gens[sched.current_device()].initial_seed(),
        "get_rng_state": get_rng_state, "set_rng_state": set_rng_state,
        "get_rng_state_all": lambda: [g.get_state() for g in gens],
        "set_rng_state_all": set_rng_state_all,
    }


class _GeneratorType(type):
    """``torch.Generator`` while simulated: ``device="cuda"`` makes a :class:`SimGenerator`;
    other devices, and ``isinstance`` of real generators, are torch's own."""

    def __instancecheck__(cls, obj: Any) -> bool:
        return isinstance(obj, _RealGenerator)

    def __subclasscheck__(cls, sub: Any) -> bool:
        return isinstance(sub, type) and issubclass(sub, _RealGenerator)

    def __call__(cls, device: Any = "cpu") -> Any:
        sim = current()
        dev = torch.device(device) if isinstance(device, (str, int)) and \
            not isinstance(device, bool) else device
        if isinstance(device, int) and not isinstance(device, bool):
            dev = torch.device("cuda", device)
        if sim is None or not isinstance(dev, torch.device) or dev.type != "cuda":
            return _RealGenerator(device)
        return SimGenerator(sim.sched.device_index(dev), DEFAULT_SEED)


class Generator(metaclass=_GeneratorType):
    """``torch.Generator`` while a simulator is open (see :class:`_GeneratorType`)."""


def install(sim: SimState) -> Any:
    """Put the simulated default generators in ``torch.cuda.default_generators``; returns the
    undo."""
    cuda = torch.cuda
    saved = getattr(cuda, "default_generators", ())
    ours = tuple(_defaults(sim))
    cuda.default_generators = ours  # type: ignore[assignment]

    def restore() -> None:
        if getattr(cuda, "default_generators", None) is ours:
            cuda.default_generators = saved  # type: ignore[assignment]
    return restore



for _f in RANDOM_FACTORIES:
    FACTORIES[_f] = random_factory
