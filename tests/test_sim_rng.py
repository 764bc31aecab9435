"""Random numbers on the simulated CUDA (issue 17 item 4): ``torch.cuda.manual_seed`` and the
rest of ``torch.cuda.random``, ``torch.Generator(device="cuda")`` with torch's random ops, and
random kernels in CUDA graphs. What is checked is what CUDA guarantees: the same seed (or a
restored state) gives the same numbers, a state is 16 bytes of seed and offset, a graph's
replays draw fresh numbers and match the same kernels run eagerly from the same state."""

from __future__ import annotations

import pytest
import torch

from pinstage.testing import simulated_accelerator

pytestmark = pytest.mark.timeout(120)
SCHEDULES = [("eager", 0), ("lazy", 0), *(("random", s) for s in range(2))]


def _draws(gen: torch.Generator | None = None) -> list[list[float]]:
    """One of each random op on simulated cuda tensors."""
    kw = {} if gen is None else {"generator": gen}
    out = [torch.rand(5, device="cuda", **kw), torch.randn(5, device="cuda", **kw),
           torch.randint(0, 1000, (5,), device="cuda", **kw).float(),
           torch.empty(5, device="cuda").uniform_(-1, 1, **kw),
           torch.empty(5, device="cuda").normal_(3.0, 0.5, **kw),
           torch.empty(50, device="cuda").bernoulli_(0.5, **kw)]
    return [t.tolist() for t in out]


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_manual_seed_reproduces_and_is_schedule_independent(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        torch.cuda.manual_seed(2)
        assert torch.cuda.initial_seed() == 2
        first = _draws()
        torch.cuda.manual_seed(2)
        assert _draws() == first
        assert _draws() != first  # the sequence moves on
        # torch.manual_seed seeds every CUDA device too, as in torch
        torch.manual_seed(2)
        assert _draws() == first
    with simulated_accelerator("eager") as sim:  # another schedule: the same numbers
        assert sim is not None
        torch.cuda.manual_seed(2)
        assert _draws() == first


def test_rng_state_is_seed_and_offset_and_restores():
    with simulated_accelerator("lazy"):
        torch.cuda.manual_seed(258)
        state = torch.cuda.get_rng_state()
        assert state.dtype == torch.uint8 and state.shape == (16,)  # as CUDA's Philox state
        assert state[:8].tolist() == [2, 1, 0, 0, 0, 0, 0, 0]  # seed 258, little-endian
        assert state[8:].tolist() == [0] * 8  # offset 0 after seeding
        a = _draws()
        assert torch.cuda.get_rng_state()[8:].tolist() != [0] * 8  # kernels took offsets
        torch.cuda.set_rng_state(state)
        assert _draws() == a
        # the functions that torch's own tests use (freeze_rng_state, fork_rng)
        with torch.random.fork_rng(devices=[0]):
            torch.cuda.manual_seed(99)
            _draws()
        assert torch.cuda.get_rng_state_all()[0].tolist() == \
            torch.cuda.default_generators[0].get_state().tolist()
        with pytest.raises(ValueError, match="wrong size"):
            torch.cuda.set_rng_state(torch.zeros(5, dtype=torch.uint8))
        with pytest.raises(TypeError, match="ByteTensor"):
            torch.cuda.set_rng_state(torch.zeros(16))


def test_seed_and_seed_all_pick_new_seeds():
    with simulated_accelerator("lazy", device_count=2):
        assert torch.cuda.initial_seed() == 67280421310721  # CUDA's default seed
        torch.cuda.seed()  # a non-deterministic seed for the current device only
        s0 = torch.cuda.initial_seed()
        assert s0 != 67280421310721
        assert torch.cuda.default_generators[1].initial_seed() == 67280421310721
        torch.cuda.seed_all()  # one new seed for all
        seeds = [g.initial_seed() for g in torch.cuda.default_generators]
        assert len(seeds) == 2 and seeds[0] == seeds[1] != s0
        torch.cuda.manual_seed_all(11)
        assert [g.initial_seed() for g in torch.cuda.default_generators] == [11, 11]


@pytest.mark.parametrize("mode,seed", SCHEDULES[:3])
def test_cuda_generator_is_its_own_stream_of_numbers(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        g = torch.Generator(device="cuda")
        assert isinstance(g, torch.Generator) and g.device == torch.device("cuda", 0)
        g.manual_seed(1)
        state = g.get_state()
        default_before = torch.cuda.get_rng_state()
        a = _draws(g)
        assert torch.cuda.get_rng_state().tolist() == default_before.tolist()  # untouched
        g.set_state(state)
        assert _draws(g) == a
        h = torch.Generator(device="cuda").manual_seed(1)
        assert _draws(h) == a  # a fresh generator with the same seed: the same numbers
        offset = g.get_offset()
        assert offset > 0 and offset % 4 == 0
        cpu = torch.Generator()  # a CPU generator for a CUDA kernel: refused, as in torch
        with pytest.raises(RuntimeError, match="Expected a 'cuda' device type for generator"):
            torch.empty(3, device="cuda").uniform_(generator=cpu)


def test_dropout_masks_and_scales_as_cuda_does():
    with simulated_accelerator("lazy"):
        torch.cuda.manual_seed(0)
        x = torch.full((2000,), 3.0, device="cuda")
        y = torch.nn.functional.dropout(x, p=0.25)
        values = set(y.tolist())
        assert values == {0.0, 4.0}  # kept values scaled by 1 / (1 - p)
        kept = sum(v == 4.0 for v in y.tolist())
        assert 1300 < kept < 1700  # ~75% kept
        torch.cuda.manual_seed(0)
        assert torch.nn.functional.dropout(x, p=0.25).tolist() == y.tolist()
        assert torch.nn.functional.dropout(x, p=0.25, training=False).tolist() == x.tolist()
        out, mask = torch.native_dropout(x, 0.25, True)
        assert mask.dtype == torch.bool and mask.device.type == "cuda"
        assert (out == x * mask / 0.75).all().item()


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_graph_replays_draw_fresh_numbers_that_match_eager(mode, seed):
    with simulated_accelerator(mode, seed=seed):
        x = torch.ones(64, device="cuda")
        g = torch.cuda.CUDAGraph()
        side = torch.Generator(device="cuda").manual_seed(5)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        before = torch.cuda.get_rng_state().tolist()
        with torch.cuda.stream(s):
            g.capture_begin()
            outs = [torch.nn.functional.dropout(x, 0.5), torch.rand(4, device="cuda"),
                    torch.empty(4, device="cuda").normal_(generator=side),
                    torch.randn(4, device="cuda")]
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        assert torch.cuda.get_rng_state().tolist() == before  # capturing took no offsets

        def eager() -> list[list[float]]:
            return [torch.nn.functional.dropout(x, 0.5).tolist(),
                    torch.rand(4, device="cuda").tolist(),
                    torch.empty(4, device="cuda").normal_(generator=side).tolist(),
                    torch.randn(4, device="cuda").tolist()]

        torch.cuda.manual_seed(7)
        side.manual_seed(5)
        replays = []
        for _ in range(2):
            g.replay()
            replays.append([t.tolist() for t in outs])
        assert replays[0] != replays[1]  # fresh numbers at each replay
        assert torch.cuda.get_rng_state()[8:].tolist() == [24] + [0] * 7  # 3 kernels, twice
        torch.cuda.manual_seed(7)
        side.manual_seed(5)
        assert [eager(), eager()] == replays


def test_everything_put_back_on_close():
    real_generator = torch.Generator
    real_seed = torch.cuda.manual_seed
    with simulated_accelerator("lazy"):
        assert torch.Generator is not real_generator
        torch.cuda.manual_seed(1)  # no longer a no-op
        g = torch.Generator(device="cuda")
        assert torch.Generator().device.type == "cpu"
    assert torch.Generator is real_generator
    assert torch.cuda.manual_seed is real_seed
    assert torch.cuda.random.manual_seed is real_seed
    assert torch.cuda.default_generators == ()
    assert g.initial_seed() == 67280421310721  # CUDA's default seed
    with pytest.raises(RuntimeError):
        torch.Generator(device="cuda")  # a CPU-only build of torch refuses, as before


_KERNELS = {
    "bernoulli": lambda t: torch.bernoulli(t),
    "bernoulli_": lambda t: torch.empty_like(t).bernoulli_(t),
    "normal(tensor, float)": lambda t: torch.normal(t + 1, 1.0),
    "poisson": lambda t: torch.poisson(t),
    "cauchy_": lambda t: torch.empty_like(t).cauchy_(),
    "exponential_": lambda t: torch.empty_like(t).exponential_(),
    "geometric_": lambda t: torch.empty_like(t).geometric_(0.3),
    "log_normal_": lambda t: torch.empty_like(t).log_normal_(),
    "random_": lambda t: torch.empty_like(t).random_(),
    "randint": lambda t: torch.randint(0, 3, (64,), device="cuda", dtype=torch.float),
    "rand_like": lambda t: torch.rand_like(t),
    "randn_like": lambda t: torch.randn_like(t),
    "randint_like": lambda t: torch.randint_like(t, 10),
    "rrelu": lambda t: torch.nn.functional.rrelu(t - 0.5, training=True),
    "multinomial": lambda t: torch.multinomial(t + 0.1, 8, replacement=True).float(),
}


@pytest.mark.parametrize("name", sorted(_KERNELS))
def test_each_random_kernel_replays_as_eager(name):
    """Per kernel: seeded, then one dummy draw; eager twice vs. a graph of two replayed
    after the same seed and dummy draw: the same values, and not the values of the seed
    before (PyTorch's test_graph_rng_distributions checks the same)."""
    make = _KERNELS[name]
    with simulated_accelerator("lazy"):
        torch.cuda.manual_seed(0)
        base = torch.rand(64, device="cuda")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            make(base)  # (warm-up outside the capture)
            g.capture_begin()
            outs = [make(base), make(base)]
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        results = []
        for seed in (6, 314):
            torch.cuda.manual_seed(seed)
            make(base)
            control = [make(base).tolist(), make(base).tolist()]
            torch.cuda.manual_seed(seed)
            make(base)
            g.replay()
            results.append([o.tolist() for o in outs])
            assert results[-1] == control
        assert results[0] != results[1]


def test_graphsafe_states_are_shared_and_clones_are_copies():
    """CUDA's graph-safe generator states: ``graphsafe_get_state`` shares the generator's
    state, ``clone_state`` copies it, ``graphsafe_set_state`` switches the generator to
    another state; a captured kernel keeps the state it was captured with (CUDA's kernels
    read that state's seed and offset at replay)."""
    def at_seed_0(skip: int) -> list[float]:  # the numbers of seed 0 after `skip` draws
        ref = torch.Generator(device="cuda")
        ref.manual_seed(0)
        for _ in range(skip):
            torch.rand(4, device="cuda", generator=ref)
        return torch.rand(4, device="cuda", generator=ref).tolist()

    with simulated_accelerator("lazy"):
        gen = torch.cuda.default_generators[0]
        gen.manual_seed(0)
        shared, copy = gen.graphsafe_get_state(), gen.clone_state()
        torch.rand(4, device="cuda")
        assert shared.get_offset() == gen.get_offset() == 4 and copy.get_offset() == 0
        s = torch.cuda.Stream()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(s):
            g.capture_begin()
            out = torch.rand(4, device="cuda")
            g.capture_end()
        g.register_generator_state(copy)
        torch.cuda.current_stream().wait_stream(s)
        gen.graphsafe_set_state(copy)  # the generator now draws from `copy` (seed 0, at 0)
        g.replay()  # ... but the graph's kernel from the state it was captured with
        assert out.tolist() == at_seed_0(1)
        assert (shared.get_offset(), copy.get_offset()) == (8, 0)
        assert torch.rand(4, device="cuda").tolist() == at_seed_0(0)
        assert copy.get_offset() == gen.get_offset() == 4  # the generator and `copy`: one


@pytest.mark.parametrize("mode,seed", SCHEDULES)
def test_a_graph_over_two_registered_states_advances_each_by_its_own_kernels(mode, seed):
    """PyTorch's test_graphsafe_set_get_rng_state: a graph that switches its generator
    between two registered states draws each kernel from the state it was captured with, and
    each replay moves each state on by its own kernels (4 per launch): the same offsets and
    numbers as the kernels run eagerly on a second generator."""
    def states(gen):
        gen.manual_seed(0)
        return gen.graphsafe_get_state(), gen.clone_state()

    def draw(gen, old, new):
        gen.graphsafe_set_state(new)
        out = [torch.rand(5, device="cuda", generator=gen)]
        gen.graphsafe_set_state(old)
        return out + [torch.rand(5, device="cuda", generator=gen) for _ in range(2)]

    with simulated_accelerator(mode, seed=seed):
        eager_gen = torch.Generator(device="cuda")
        e_old, e_new = states(eager_gen)
        graph_gen = torch.cuda.default_generators[0]
        g_old, g_new = states(graph_gen)
        g, s = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        g.register_generator_state(g_old)
        g.register_generator_state(g_new)
        with torch.cuda.stream(s):
            g.capture_begin()
            graphed = draw(graph_gen, g_old, g_new)
            g.capture_end()
        torch.cuda.current_stream().wait_stream(s)
        assert (g_old.get_offset(), g_new.get_offset()) == (0, 0)  # (capture draws nothing)
        for i in range(1, 4):
            eager = draw(eager_gen, e_old, e_new)
            g.replay()
            assert (e_old.get_offset(), e_new.get_offset()) == (8 * i, 4 * i)
            assert (g_old.get_offset(), g_new.get_offset()) == (8 * i, 4 * i)
            assert [t.tolist() for t in graphed] == [t.tolist() for t in eager]


def test_random_kernels_leave_nothing_behind_per_call():
    """Each random kernel runs through a wrapper made per call; the simulator's per-op plans
    and shape cache are the aten op's, so a long run of random ops does not grow them (it
    added two plans and two cache entries per op, never freed)."""
    from pinstage._sim import _ops

    with simulated_accelerator("eager"):
        x = torch.empty(64, device="cuda")

        def ops(n):
            for _ in range(n):
                x.uniform_()
                torch.nn.functional.dropout(x, 0.5)
                torch.rand(8, device="cuda")
            return len(_ops._PLANS), len(_ops._META_CACHE)

        first = ops(5)
        assert ops(200) == first
