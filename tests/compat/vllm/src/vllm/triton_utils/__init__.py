"""pinstage compat shim, not vLLM code: vllm.triton_utils. With Triton installed, Triton itself;
without it (CPU CI), `triton.jit` makes a kernel object whose `kernel[grid](...)` launch calls
its `run`, as Triton's JITFunction does, and `run` refuses until a PyTorch stand-in is
registered with pinstage.testing.register_kernel (tests/compat/vllm/standins.py does)."""

try:
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
except ImportError:
    import types

    class _Kernel:
        def __init__(self, fn):  # type: ignore[no-untyped-def]
            self.fn = fn
            self.__name__ = fn.__name__

        def __getitem__(self, grid):  # type: ignore[no-untyped-def]
            return lambda *args, **kwargs: self.run(*args, grid=grid, warmup=False, **kwargs)

        def run(self, *args, grid, warmup, **kwargs):  # type: ignore[no-untyped-def]
            raise RuntimeError(f"Triton is not installed: no stand-in registered for "
                               f"{self.__name__} (pinstage.testing.register_kernel)")

    class _Anything:
        def __getattr__(self, name):  # type: ignore[no-untyped-def]
            return _Anything()

        def __call__(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            return _Anything()

    triton = types.SimpleNamespace(jit=_Kernel, cdiv=lambda a, b: -(a // -b))
    tl = _Anything()
