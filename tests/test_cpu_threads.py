"""Threads: --threads sets PyTorch's CPU threads for the engine; without it the default is one per physical
core this process may use (hyperthread siblings count once), unless OMP_NUM_THREADS chose already."""
from __future__ import annotations

import pytest
import torch
from server_harness import tiny_model_dir

from tercel import LLM
from tercel.cpu_threads import default_threads, physical_cores


def fake_topology(root, cores: dict[int, tuple[int, int]]):
    """cpuN -> (package, core) as Linux's /sys/devices/system/cpu lays it out."""
    for cpu, (package, core) in cores.items():
        top = root / f"cpu{cpu}" / "topology"
        top.mkdir(parents=True)
        (top / "physical_package_id").write_text(f"{package}\n")
        (top / "core_id").write_text(f"{core}\n")
    return root


def test_hyperthread_siblings_count_once(tmp_path):
    # 2 packages x 2 cores x 2 threads: cpu0/cpu4 are one core's siblings, and so on
    top = fake_topology(tmp_path, {cpu: (cpu // 2 % 2, cpu % 2) for cpu in range(8)})
    assert physical_cores(set(range(8)), top) == 4
    assert physical_cores({0, 4}, top) == 1  # an affinity mask of two siblings: one core
    assert physical_cores({0, 1, 2}, top) == 3


def test_unreadable_topology_counts_the_usable_cpus(tmp_path):
    assert physical_cores({0, 1, 2}, tmp_path / "missing") == 3


def test_omp_num_threads_keeps_its_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert default_threads() is None
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert default_threads() == physical_cores()


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_engine_honours_threads_and_defaults_to_physical_cores(restore_threads, monkeypatch):
    model = str(tiny_model_dir())
    kw = dict(dtype="float32", device="cpu", progress=False, max_model_len=64, kv_cache_memory=4 << 20)
    LLM(model, threads=1, **kw)
    assert torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    LLM(model, **kw)
    assert torch.get_num_threads() == physical_cores()
