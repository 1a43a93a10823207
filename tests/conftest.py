import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def use_world(size: int) -> None:
    """(Re)start the fake process group with ``size`` ranks."""
    if dist.is_initialized():
        if dist.get_world_size() == size:
            return
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=size)


@pytest.fixture
def world():
    return use_world
