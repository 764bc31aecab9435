"""Facts about the host platform (WSL, containers) that decide what pinned memory can do."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["WslInfo", "wsl_info", "in_container", "confidential_vm", "WSL_MIN_KERNEL",
           "WSL_STAGING_LIMIT"]

# vLLM enables pinned memory on WSL only from this kernel on (earlier WSL 2 kernels could not
# pin at all). We keep the same floor.
WSL_MIN_KERNEL = (4, 19, 121)
# WSL and Docker-on-WSL fail to pin beyond ~0.5-1 GiB in total (microsoft/WSL #14078). pinstage
# pins only a bounded staging arena, so it keeps that arena well under the limit by default.
WSL_STAGING_LIMIT = 64 * 2**20


@dataclass(frozen=True)
class WslInfo:
    release: str
    kernel: tuple[int, ...]

    @property
    def pinning_works(self) -> bool:
        return self.kernel >= WSL_MIN_KERNEL


def _osrelease() -> str:
    try:
        with open("/proc/sys/kernel/osrelease", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


def wsl_info(release: str | None = None) -> WslInfo | None:
    """``WslInfo`` when running under WSL (the kernel release names Microsoft), else ``None``."""
    release = _osrelease() if release is None else release
    if "microsoft" not in release.lower():
        return None
    nums = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", release)
    kernel = tuple(int(x) for x in nums.groups(default="0")) if nums else (0, 0, 0)
    return WslInfo(release, kernel)


def in_container() -> bool:
    """Best-effort: running in a Docker/Podman/Kubernetes container."""
    if os.path.exists("/.dockerenv") or os.path.exists("/run/.containerenv"):
        return True
    try:
        with open("/proc/1/cgroup", encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    return any(k in text for k in ("docker", "kubepods", "containerd", "libpod"))


def confidential_vm() -> str | None:
    """The confidential-computing guest technology this VM runs under, if its guest device is
    visible (GPU Confidential Computing needs one): ``"Intel TDX"``, ``"AMD SEV-SNP"``, else
    ``None``."""
    if os.path.exists("/dev/tdx_guest"):
        return "Intel TDX"
    if os.path.exists("/dev/sev-guest"):
        return "AMD SEV-SNP"
    return None
