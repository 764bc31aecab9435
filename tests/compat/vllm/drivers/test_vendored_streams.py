"""pinstage's drivers (not vLLM's tests) for what vLLM's code does to torch itself, on the
simulated CUDA: vLLM patches ``torch.cuda.set_stream`` at import to track its current stream
(vllm/utils/torch_utils.py), and its UVA test reads host memory written by the device."""

from __future__ import annotations

import threading

import pytest
import torch

import vllm.utils._torch_utils_vllm as vllm_torch_utils
from vllm.utils.torch_utils import current_stream, get_accelerator_view_from_cpu_tensor

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs (simulated) CUDA")


@cuda_only
def test_vllm_set_stream_patch_survives_the_simulator():
    """vLLM's patch stays installed, and sees every stream change, including a
    ``torch.cuda.stream`` context's (as on CUDA), per thread."""
    assert torch.cuda.set_stream is vllm_torch_utils._patched_set_stream
    vllm_torch_utils._current_stream_tls.value = None  # (an earlier test's stream)
    first = current_stream()  # vLLM's: sets a dedicated stream through its patch
    assert first is torch.cuda.current_stream()
    other = torch.cuda.Stream()
    seen: list[object] = []

    def child() -> None:
        with torch.cuda.stream(other):
            seen.append(current_stream())

    t = threading.Thread(target=child)
    t.start()
    t.join()
    assert seen == [other]
    assert current_stream() is first
    with torch.cuda.stream(other):
        assert current_stream() is other
    assert current_stream() is first


@cuda_only
def test_unsynchronized_read_of_device_writes_is_caught():
    """vLLM's test_uva.py::test_gpu_write as some of its revisions have it: host reads right
    after device writes through the UVA view, with no synchronize. On a GPU that read races
    the kernel: the simulator raises at the host's read, in every mode (in eager, where the
    kernel has run, too). (With the synchronize, as vendored, it passes.)"""
    from pinstage.testing import HazardError

    cpu_tensor = torch.zeros(4, dtype=torch.int32, device="cpu", pin_memory=True)
    view = get_accelerator_view_from_cpu_tensor(cpu_tensor)
    view[1] = 1
    view.mul_(2)
    with pytest.raises(HazardError, match="host race"):
        int(cpu_tensor[1])
    torch.accelerator.synchronize()
    assert int(cpu_tensor[1]) == 2
