import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def use_world(size: int) -> None:
    """(Re)start the fake process group with ``size`` ranks."""
    if dist.is_initialized():
        if dist.get_world_size() == size:
            return
        dist.destroy_process_group()
    # DTensor caches sharding decisions by mesh, and meshes of equal shape compare equal:
    # a cached answer would carry a mesh whose groups died with the old process group.
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


@pytest.fixture
def world():
    return use_world


@pytest.fixture(autouse=True)
def _fresh_sharding_cache():
    """DTensor caches sharding decisions keyed by meshes that compare equal across tests
    (same shape and names); a cached decision would carry another test's mesh, whose
    groups may be gone (LocalTensorMode meshes, re-created process groups)."""
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()
    yield
