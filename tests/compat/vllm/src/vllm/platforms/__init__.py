"""pinstage compat shim, not vLLM code: vllm.platforms: a CUDA platform when torch.cuda is available
(a real GPU or pinstage's simulated one), else the CPU platform. Asked at each call, so it
follows the simulator opening and closing."""

import torch


class _Platform:
    @property
    def device_type(self) -> str:
        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def device_name(self) -> str:
        return self.device_type

    @property
    def dispatch_key(self) -> str:
        return "CUDA" if self.is_cuda() else "CPU"

    current_stream = None

    def is_cuda(self) -> bool:
        return torch.cuda.is_available()

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return not self.is_cuda()

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)


current_platform = _Platform()
