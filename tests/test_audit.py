"""Hidden-sync audit, with the meta device standing in for an accelerator."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

import pinstage
from pinstage import HiddenSyncError, audit

META = torch.device("meta")
META_ERRORS = (RuntimeError, NotImplementedError)  # meta tensors have no data to read


def kinds(report):
    return {f.kind: f.count for f in report.findings}


def test_each_kind_is_found_with_its_call_site():
    dev = torch.empty(4, device=META)
    host = torch.arange(4)
    with audit() as report:
        dev.copy_(host, non_blocking=True)  # pageable-nonblocking
        dev.copy_(host)  # blocking-h2d
        host.to(META)  # blocking-h2d
        host.to(META, non_blocking=True)  # pageable-nonblocking
        with pytest.raises(META_ERRORS):
            dev[0].item()  # item (meta has no data, but the read is seen first)
        with pytest.raises(META_ERRORS):
            dev.cpu()  # d2h
    k = report.counts()
    assert k == {"pageable-nonblocking": 2, "blocking-h2d": 2, "item": 1, "d2h": 1}
    for f in report.findings:
        assert f.where.startswith(__file__ + ":")
        assert f.message and f.count >= 1


def test_findings_grouped_by_site_most_frequent_first():
    dev = torch.empty(2, device=META)
    with audit() as report:
        for _ in range(5):
            dev.copy_(torch.ones(2))
        dev.copy_(torch.ones(2), non_blocking=True)
    assert [f.count for f in report.findings] == [5, 1]
    text = report.summary()
    assert text.index("blocking-h2d") < text.index("pageable-nonblocking")
    assert "5x" in text


def test_strict_raises_at_first_finding():
    dev = torch.empty(2, device=META)
    with pytest.raises(HiddenSyncError, match="blocking-h2d") as info:
        with audit(strict=True):
            dev.copy_(torch.ones(2))
    assert __file__ in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_devices_selects_what_counts():
    dev = torch.empty(2, device=META)
    with audit(devices={"cuda"}) as report:
        dev.copy_(torch.ones(2))
    assert report.findings == []
    with audit(devices=["meta"]) as report:
        dev.copy_(torch.ones(2))
    assert len(report.findings) == 1


def test_cpu_work_is_not_a_finding():
    with audit() as report:
        a = torch.arange(10)
        b = a.clone()
        b.copy_(a, non_blocking=True)
        assert a.sum().item() == 45
        a.tolist()
    assert report.findings == []
    assert "no hidden syncs" in report.summary()


def test_only_the_entering_thread_is_watched():
    import threading

    dev = torch.empty(2, device=META)
    with audit() as report:
        t = threading.Thread(target=lambda: dev.copy_(torch.ones(2)))
        t.start()
        t.join()
    assert report.findings == []


def test_pinstage_primitives_produce_no_findings():
    with audit(strict=True):
        pinstage.async_tensor_h2d([1, 2, 3], device=META)
        pinstage.async_tensor_h2d(np.arange(6).reshape(2, 3)[:, ::2], device=META)
        pinstage.h2d_many([[1], [2.0]], device=META)
        buf = pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=META)
        buf.copy_to_gpu(2)
        swt = pinstage.StagedWriteTensor((4, 4), torch.int32, META)
        swt.stage_write(1, 0, [1, 2])
        swt.apply_write()
        pool = pinstage.UvaBufferPool(4, torch.int32, device=META)
        pool.copy_to_uva([1, 2])
        pool.copy_to_gpu([1, 2])
        pinstage.UvaBackedTensor(4, torch.int32, device=META).copy_to_uva()
    from pinstage.testing import simulated_accelerator

    with simulated_accelerator("random") as sim, audit(strict=True):
        pinstage.async_tensor_h2d([1, 2, 3], device=sim.device)
        pinstage.CpuGpuBuffer(4, dtype=torch.int32, device=sim.device).copy_to_gpu()


def test_pytest_fixture_is_registered(tmp_path):
    test = tmp_path / "test_user.py"
    test.write_text(textwrap.dedent("""
        import torch

        def test_clean(no_hidden_syncs):
            torch.arange(3).sum()

        def test_dirty(no_hidden_syncs):
            torch.empty(2, device="meta").copy_(torch.ones(2))
    """))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(test)], capture_output=True, text=True, cwd=tmp_path)
    assert "1 failed, 1 passed" in proc.stdout, proc.stdout + proc.stderr
    assert "blocking-h2d" in proc.stdout


def test_bad_devices_argument():
    with pytest.raises(TypeError):
        with audit(devices=[3]):
            pass


def test_noncontiguous_pinned_and_pinned_d2h(monkeypatch):
    """A CPU-only build can't pin, so pretend: the classifier asks is_pinned() of the tensor."""
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a, **k: True)
    dev = torch.empty(4, 4, device=META)
    src = torch.ones(4, 8)[:, ::2]  # "pinned", non-contiguous
    with audit() as report:
        dev.copy_(src, non_blocking=True)
        dev.copy_(torch.ones(4, 4), non_blocking=True)  # "pinned" contiguous: fine
        host = torch.empty(4, 4)
        with pytest.raises(META_ERRORS):
            host.copy_(dev, non_blocking=True)  # into "pinned" memory: not a finding
    assert report.counts() == {"noncontiguous-pinned": 1}


def test_d2h_into_pageable_even_non_blocking():
    dev = torch.empty(4, device=META)
    with audit() as report:
        with pytest.raises(META_ERRORS):
            torch.empty(4).copy_(dev, non_blocking=True)
    assert report.counts() == {"d2h": 1}


def test_data_dependent_shapes_are_found():
    x = torch.empty(6, device=META)
    mask = torch.empty(6, dtype=torch.bool, device=META)
    reps = torch.empty(6, dtype=torch.int64, device=META)
    with audit() as report:
        for op in (lambda: torch.nonzero(x), lambda: x[mask], lambda: x.masked_select(mask),
                   lambda: torch.unique(x), lambda: reps.repeat_interleave(reps)):
            try:
                op()
            except META_ERRORS:
                pass  # meta can't compute these; the audit saw them first
        x.repeat_interleave(reps, output_size=12)  # sized: no sync
    assert report.counts() == {"data-dependent": 5}
